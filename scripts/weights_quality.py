"""What each ``weights`` setting costs in quality, against the target dtype's own weights.

For every setting (``dtype``, ``float16``, ``int8-head``, ``int8``) the target is loaded as a stack would
load it (the lean forward and LM head on that setting's kernels), then:

- **log-likelihood on held text**: the mean log-probability per token of ShareGPT dev-split
  conversations (the first human turn in the target's prompt format, then the first answer), at most
  ``--tokens`` tokens each, teacher-forced; reported with its relative difference to ``dtype``;
- **next-token agreement**: on the same positions, how often the setting's argmax equals ``dtype``'s;
- **greedy agreement**: plain greedy decoding of the first ``--prompts`` dev-protocol prompts
  (64 new tokens), how many outputs equal ``dtype``'s token for token, and the mean length of the
  common prefix.

    python scripts/weights_quality.py --target gemma3-270m --texts 16 --prompts 12 --json-out q.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def load(target_name: str, weights: str, dtype: str):
    """The target with ``weights``: a setting, or ``w8a8@P+Q`` for w8a8 keeping products P and Q
    (of qkv, o, gate_up, down, lm_head) at 16-bit activations instead of the target's own choice
    (``w8a8@`` keeps none)."""
    from dynaspec.runtime.numerics import resolve_dtype
    from dynaspec.runtime.quantized import resolve_weights
    from dynaspec.runtime.targets import load_target

    name, keep, kept = weights.partition("@")
    target = load_target(target_name).to(dtype=resolve_dtype(dtype))
    if keep:
        target.w8a8_int16 = frozenset(p for p in kept.split("+") if p)
    target.use_weights(resolve_weights(name)).make_batch_invariant()
    return target


@torch.inference_mode()
def teacher_forced(target, ids: list[int]) -> tuple[float, int, torch.Tensor]:
    """Sum of log-probabilities of ``ids[1:]``, their count, and the argmax at each position."""
    x = torch.tensor(ids)
    hidden = target.forward(x, torch.arange(len(ids)), target.new_cache(len(ids) + 1))
    total, argmax = 0.0, []
    for start in range(0, len(ids) - 1, 64):
        logits = target.logits(hidden[start:min(start + 64, len(ids) - 1)])
        logp = torch.log_softmax(logits, dim=-1)
        total += float(logp.gather(1, x[start + 1:start + 1 + logits.shape[0], None]).sum())
        argmax.append(logits.argmax(-1))
    return total, len(ids) - 1, torch.cat(argmax)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", default="dtype,float16,int8-head", help="comma-separated settings (w8a8@P+Q: w8a8 keeping products P, Q at 16-bit activations); the first "
                        "is the reference")
    parser.add_argument("--texts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=384)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from dynaspec.runtime.engine import Engine
    from dynaspec.training.data import dev_protocol_prompts, first_answer, first_human_turn, load_split

    settings = args.weights.split(",")
    rows = []
    reference = None
    for weights in settings:
        target = load(args.target, weights, args.dtype)
        texts = []
        for conv in load_split("dev"):
            human, answer = first_human_turn(conv), first_answer(conv)
            if human and answer:
                texts.append(target.format_prompt(human[:1500]) + answer[:4000])
            if len(texts) >= args.texts:
                break
        total, count, argmax = 0.0, 0, []
        for text in texts:
            ids = target.tokenizer(text)["input_ids"][:args.tokens]
            s, n, a = teacher_forced(target, ids)
            total, count = total + s, count + n
            argmax.append(a)
        engine = Engine.from_stack("baseline", overrides={"target": args.target, "dtype": args.dtype,
                                                          "weights": weights.partition("@")[0]}, target=target)
        outputs = [engine.generate(target.format_prompt(p["text"]), max_new_tokens=args.new_tokens).token_ids
                   for p in dev_protocol_prompts(args.prompts)]
        row = {"weights": weights, "kernels": target.batch_invariance, "mean_log_likelihood": total / count,
               "tokens": count}
        if reference is None:
            reference = (row, argmax, outputs)
        ref_row, ref_argmax, ref_outputs = reference
        row["relative_ll_difference"] = (row["mean_log_likelihood"] - ref_row["mean_log_likelihood"]) / abs(
            ref_row["mean_log_likelihood"])
        row["next_token_agreement"] = float(sum((a == b).sum() for a, b in zip(argmax, ref_argmax)) / count)
        row["greedy_identical"] = sum(a == b for a, b in zip(outputs, ref_outputs))
        prefixes = []
        for a, b in zip(outputs, ref_outputs):
            same = 0
            while same < min(len(a), len(b)) and a[same] == b[same]:
                same += 1
            prefixes.append(same)
        row["greedy_common_prefix"] = sum(prefixes) / len(prefixes)
        row["greedy_outputs"] = len(outputs)
        rows.append(row)
        print(f"{weights:>10}: mean log-likelihood {row['mean_log_likelihood']:.4f} "
              f"({100 * row['relative_ll_difference']:+.3f}%), next-token agreement "
              f"{100 * row['next_token_agreement']:.2f}%, greedy identical {row['greedy_identical']}/{len(outputs)}, "
              f"common prefix {row['greedy_common_prefix']:.1f} of {args.new_tokens}", flush=True)
        del engine, target
    print(f"\n| weights | mean log-likelihood ({count} tokens of {args.texts} dev texts) | vs {settings[0]} | "
          f"next-token agreement | greedy identical ({args.prompts} prompts, {args.new_tokens} tokens) | "
          "common prefix |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['weights']} | {row['mean_log_likelihood']:.4f} | {100 * row['relative_ll_difference']:+.3f}% | "
              f"{100 * row['next_token_agreement']:.2f}% | {row['greedy_identical']}/{row['greedy_outputs']} | "
              f"{row['greedy_common_prefix']:.1f} |")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"target": args.target, "dtype": args.dtype, "texts": args.texts, "tokens": args.tokens,
                       "prompts": args.prompts, "new_tokens": args.new_tokens, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
