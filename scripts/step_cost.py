"""What one plain step and one verification cost the target, by ``weights`` setting: the decoder
body (``TargetModel.forward`` of 1 or 4 new tokens after a short prompt, on the strict kernels a
stack with ``exact = "required"`` uses) and the LM head (``TargetModel.logits`` of 1 or 4 rows;
with float32 weights on a CPU that pads, a greedy plain step first tries the cheaper certified
one-row product, which this does not time). Medians of 15. Unlike ``rows_cost.py`` (one product,
its weights hot in the cache), every weight of the target streams from memory once a pass, as in
decoding.

    python scripts/step_cost.py --target gemma3-270m --weights dtype,float16,int8-head,int8 --threads 1
    python scripts/step_cost.py --target qwen2.5-coder-0.5b --dtype auto --weights int8,w8a8 --rows 1,4,6,8
    python scripts/step_cost.py --target gemma3-270m --dtype auto --weights int8,w8a8@down --rows 1,6

(``w8a8@P+Q``: w8a8 keeping products P and Q at 16-bit activations, as ``target.w8a8_int16`` says.)
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--weights", default="dtype,float16,int8-head,int8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="the target's dtype (auto: as a stack's dtype = \"auto\")")
    parser.add_argument("--rows", default="1,4", help="comma-separated row counts (default 1,4)")
    args = parser.parse_args(argv)
    row_counts = [int(r) for r in args.rows.split(",")]

    import torch

    from dynaspec.runtime.numerics import resolve_dtype
    from dynaspec.runtime.targets import load_target

    torch.set_num_threads(args.threads)

    def median_ms(fn) -> float:
        fn()
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return 1e3 * statistics.median(samples)

    def measure(weights: str) -> list[float]:
        name, keep, kept = weights.partition("@")  # w8a8@P+Q: keeping P and Q at 16-bit activations
        target = load_target(args.target).to(dtype=resolve_dtype(args.dtype))
        if keep:
            target.w8a8_int16 = frozenset(p for p in kept.split("+") if p)
        target.use_weights(name).make_batch_invariant()
        ids = torch.tensor(target.tokenizer(target.format_prompt("Explain why the sky is blue, in detail."))["input_ids"])
        cache = target.new_cache(64)
        target.forward(ids, torch.arange(len(ids)), cache)
        past = len(ids)
        cells = []
        for rows in row_counts:
            def body(rows=rows):
                target.forward(ids[:rows], torch.arange(past, past + rows), cache, chain=True)
                target.keep(cache, past, [])

            cells.append(median_ms(body))
        for rows in row_counts:
            hidden = torch.randn(rows, target.hidden_size).to(target.dtype)
            cells.append(median_ms(lambda hidden=hidden: target.logits(hidden)))
        return cells

    n = len(row_counts)
    print(f"{args.target}, {args.dtype}, {args.threads} thread(s), {torch.backends.cpu.get_cpu_capability()}; ms")
    print("| weights | " + " | ".join(f"body, {r} row{'s' * (r > 1)}" for r in row_counts) + " | "
          + " | ".join(f"head, {r} row{'s' * (r > 1)}" for r in row_counts) + " | plain step | "
          + " | ".join(f"{r} rows / plain" for r in row_counts[1:]) + " |\n|---|" + "---|" * (2 * n + n))
    for weights in args.weights.split(","):
        cells = measure(weights)
        plain = cells[0] + cells[n]
        ratios = [(cells[i] + cells[n + i]) / plain for i in range(1, n)]
        print(f"| {weights} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {plain:.1f} | "
              + " | ".join(f"{r:.2f}" for r in ratios) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
