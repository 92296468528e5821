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

The teacher-forced probabilities come from the target's prompt pass, whose products may round
differently from the decoding steps' (plain sampling's own draws can sit a little off them too), so
the direct test of losslessness compares the stack's draws with plain sampling's on the same
categories: run the check with the target's plain stack too (``--stack qwen-baseline``), then

    python scripts/sampling_check.py --compare SPEC.json [SPEC2.json ...] --against PLAIN.json [...]

pools each side's counts and prints a two-sample chi-square test (a contingency table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    parser.add_argument("--first-seed", type=int, default=0,
                        help="draw i uses seed first_seed + i (another first seed: an independent run)")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--compare", nargs="+", metavar="REPORT",
                        help="no sampling: pool these reports' counts and test them against --against's")
    parser.add_argument("--against", nargs="+", metavar="REPORT", help="the reports to compare with (plain sampling)")
    args = parser.parse_args()
    if args.compare:
        return compare(args.compare, args.against or [])

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
    for seed in tqdm(range(args.first_seed, args.first_seed + args.samples), desc="samples", file=sys.stderr):
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
    report = {"stack": args.stack, "prompt": args.prompt, "samples": args.samples, "first_seed": args.first_seed,
              "tokens": args.tokens,
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


def compare(first: list[str], second: list[str]) -> int:
    """A two-sample chi-square test of the pooled category counts of two sets of reports."""
    from scipy.stats import chi2_contingency

    if not second:
        print("--compare needs --against REPORT ...", file=sys.stderr)
        return 2
    reports = [[json.loads(Path(path).read_text()) for path in paths] for paths in (first, second)]
    key = reports[0][0]
    for report in reports[0] + reports[1]:
        if (report["prompt"], report["tokens"], [r["tokens"] for r in report["rows"]]) != \
                (key["prompt"], key["tokens"], [r["tokens"] for r in key["rows"]]):
            print("the reports differ in prompt, tokens or categories", file=sys.stderr)
            return 2
    counts = [[sum(r["rows"][i]["observed"] for r in side) for i in range(len(key["rows"]))] for side in reports]
    stat, p, dof, _ = chi2_contingency(counts)
    names = [", ".join(sorted({r["stack"] for r in side})) for side in reports]
    print(f"{names[0]} ({sum(counts[0])} draws) against {names[1]} ({sum(counts[1])} draws): "
          f"chi2 = {stat:.2f} on {dof} degrees of freedom, p = {p:.3f}")
    for row, a, b in zip(key["rows"], *counts):
        print(f"  {a:>6} {b:>6}  {row['text']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
