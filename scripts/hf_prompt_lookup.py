"""Hugging Face's prompt-lookup decoding beside its own plain decoding, on the same prompts.

For each question of a Spec-Bench-format file (the built-in set by default), the first turn in the
target's prompt format is decoded greedily by ``model.generate`` twice, interleaved: plain, and
with ``prompt_lookup_num_tokens`` (Hugging Face's n-gram drafter, no training). Prints, per
category and overall, the median tokens/s of each and the median speed-up, and whether the
prompt-lookup output equals the plain output token for token (Hugging Face makes no such promise;
dynaspec's stacks are compared with their own plain decoding by ``dynaspec bench``).

    python scripts/hf_prompt_lookup.py --max-new-tokens 256 --limit-per-category 1 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--questions", default=None, help="a Spec-Bench-format file (default: the built-in set)")
    parser.add_argument("--limit-per-category", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=10, help="prompt_lookup_num_tokens (default 10)")
    parser.add_argument("--ngram", type=int, default=2, help="max_matching_ngram_size (default 2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)

    import torch

    from dynaspec.evaluation.bench import parse_questions, report_category, select
    from dynaspec.runtime.targets import load_target

    torch.set_num_threads(args.threads)
    target = load_target(args.target).to(dtype=getattr(torch, args.dtype))
    model, tok = target.model, target.tokenizer
    questions = select(parse_questions(args.questions), args.limit_per_category)
    rows = []
    for q in questions:
        ids = torch.tensor([tok(target.format_prompt(q.turns[0]))["input_ids"]])
        out = {}
        for name, extra in (("plain", {}), ("lookup", {"prompt_lookup_num_tokens": args.num_tokens,
                                                         "max_matching_ngram_size": args.ngram})):
            start = time.perf_counter()
            with torch.inference_mode():
                gen = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     attention_mask=torch.ones_like(ids), **extra)
            seconds = time.perf_counter() - start
            new = gen[0, ids.shape[1]:].tolist()
            out[name] = (new, len(new) / seconds)
        rows.append({"category": report_category(q.category), "plain_tps": out["plain"][1],
                     "lookup_tps": out["lookup"][1], "identical": out["plain"][0] == out["lookup"][0],
                     "new_tokens": len(out["plain"][0])})
        print(f"{q.question_id} {rows[-1]['category']}: plain {out['plain'][1]:.2f} tok/s, lookup "
              f"{out['lookup'][1]:.2f} tok/s, identical {rows[-1]['identical']}", file=sys.stderr)
    groups = defaultdict(list)
    for row in rows:
        groups[row["category"]].append(row)
    print(f"Hugging Face prompt lookup (num_tokens {args.num_tokens}, ngram {args.ngram}), {args.target} "
          f"{args.dtype}, {args.threads} thread(s), {args.max_new_tokens} new tokens, greedy\n")
    print("| category | prompts | plain tokens/s (median) | lookup tokens/s (median) | speed-up (median) | identical |")
    print("|---|---|---|---|---|---|")
    for cat, rs in sorted(groups.items()) + [("overall", rows)]:
        print(f"| {cat} | {len(rs)} | {statistics.median(r['plain_tps'] for r in rs):.2f} | "
              f"{statistics.median(r['lookup_tps'] for r in rs):.2f} | "
              f"{statistics.median(r['lookup_tps'] / r['plain_tps'] for r in rs):.2f}x | "
              f"{sum(r['identical'] for r in rs)}/{len(rs)} |")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"setup": vars(args), "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
