"""Does a real stack's speculative sampling keep its target's distribution? A chi-square check.

The unit tests check the sampler's distribution on tiny targets (``tests/test_sampling.py``). This
script runs the same kind of check once on a real target and stack: it samples the first
``--tokens`` tokens of one prompt ``--samples`` times with the stack (a new seed each time), and
compares the counts of the sequences against the target's own probabilities of them (temperature
and top-p applied as plain sampling applies them, on the same weights), computed exactly by
teacher-forcing each sequence through the target.

The categories are chosen before sampling, from the target alone: the most likely sequences
(the ``--branch`` likeliest tokens at each position, a tree of branch ** tokens sequences) whose
expected count is at least 5, plus one category for everything else. The stack is forced to draft
every cycle (``draft.adaptive = false``), so the check goes through the drafter, the shortlist and
the lossless verifier at every position.

    python scripts/sampling_check.py --stack default --samples 600 --json-out sampling.json

Prints the chi-square statistic and p-value, the stack's mean accepted length (the drafts were
accepted, so the verifier's acceptance rule was exercised), and the largest per-category
deviation. A p-value below 0.001 would mean the distribution is not the target's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


@torch.inference_mode()
def sequence_probabilities(engine, prompt_ids: list[int], tokens: int, branch: int,
                           temperature: float, top_p: float) -> dict[tuple[int, ...], float]:
    """The target's probability of each of the likeliest ``branch ** tokens`` continuations of
    ``prompt_ids`` (``branch`` likeliest tokens at each position), under ``temperature``/``top_p``."""
    from dynaspec.plugins.verifiers import sampling_distribution
    from dynaspec.runtime.protocols import DecodeParams

    target = engine.target
    params = DecodeParams(temperature=temperature, top_p=top_p)

    def next_probs(ids: list[int]) -> torch.Tensor:
        x = torch.tensor(ids, device=target.device)
        hidden = target.forward(x, torch.arange(len(ids), device=target.device), target.new_cache(len(ids) + 1))
        return sampling_distribution(target.logits(hidden[-1:]), params)[0].cpu()

    frontier = [((), 1.0)]
    for _ in range(tokens):
        grown = []
        for seq, p in frontier:
            top = next_probs(prompt_ids + list(seq)).topk(branch)
            grown += [((*seq, int(t)), p * float(q)) for q, t in zip(top.values, top.indices)]
        frontier = grown
    return dict(frontier)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="default")
    parser.add_argument("--prompt", default="Write a short poem about the sea.")
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--tokens", type=int, default=3, help="tokens sampled per draw (a sequence is a category)")
    parser.add_argument("--branch", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    from scipy.stats import chisquare
    from tqdm import tqdm

    from dynaspec.runtime.engine import Engine

    torch.set_num_threads(args.threads)
    engine = Engine.from_stack(args.stack, overrides={"draft.adaptive": False})
    prompt_ids = engine.target.tokenizer(engine.target.format_prompt(args.prompt))["input_ids"]
    probs = sequence_probabilities(engine, prompt_ids, args.tokens, args.branch, args.temperature, args.top_p)
    cats = sorted((s for s, p in probs.items() if p * args.samples >= 5), key=lambda s: -probs[s])
    counts = dict.fromkeys(cats, 0)
    other = 0
    accepted = []
    for seed in tqdm(range(args.samples), desc="samples", file=sys.stderr):
        result = engine.generate(prompt_ids, max_new_tokens=args.tokens, temperature=args.temperature,
                                 top_p=args.top_p, seed=seed)
        seq = tuple(result.token_ids[: args.tokens])
        accepted += result.stats.accepted_lengths
        if seq in counts:
            counts[seq] += 1
        else:
            other += 1
    expected = [probs[s] * args.samples for s in cats]
    expected.append(args.samples - sum(expected))
    observed = [counts[s] for s in cats] + [other]
    test = chisquare(observed, expected)
    worst = max(range(len(observed)), key=lambda i: abs(observed[i] - expected[i]) / max(expected[i], 1e-9) ** 0.5)
    report = {"stack": args.stack, "prompt": args.prompt, "samples": args.samples, "tokens": args.tokens,
              "temperature": args.temperature, "top_p": args.top_p, "categories": len(observed),
              "chi2": float(test.statistic), "p_value": float(test.pvalue),
              "mean_accepted_length": sum(accepted) / max(len(accepted), 1),
              "rows": [{"tokens": list(s) if s else "other", "text": engine.decode(list(s)) if s else "",
                        "observed": o, "expected": round(e, 2)}
                       for s, o, e in zip([*cats, None], observed, expected)],
              "largest_deviation": {"category": worst, "observed": observed[worst],
                                    "expected": round(expected[worst], 2)},
              "weights": engine.target.weights}
    print(f"{args.stack}: {args.samples} draws of {args.tokens} tokens, {len(observed)} categories "
          f"({len(cats)} sequences + other); chi2 = {test.statistic:.2f}, p = {test.pvalue:.3f}; "
          f"mean accepted length {report['mean_accepted_length']:.2f}; weights {engine.target.weights}")
    for row in report["rows"][:12]:
        print(f"  {row['observed']:>5} observed, {row['expected']:>8.2f} expected  {row['text']!r}")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=2, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
