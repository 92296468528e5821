"""What one plain step and one verification cost the target, by ``weights`` setting: the decoder
body (``TargetModel.forward`` of 1 or 4 new tokens after a short prompt, on the strict kernels a
stack with ``exact = "required"`` uses) and the LM head (``TargetModel.logits`` of 1 or 4 rows;
with float32 weights on a CPU that pads, a greedy plain step first tries the cheaper certified
one-row product, which this does not time). Medians of 15.

    python scripts/step_cost.py --target gemma3-270m --weights dtype,float16,int8-head,int8 --threads 1
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
    args = parser.parse_args(argv)

    import torch

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
        target = load_target(args.target).use_weights(weights)
        target.make_batch_invariant()
        ids = torch.tensor(target.tokenizer(target.format_prompt("Explain why the sky is blue."))["input_ids"])
        cache = target.new_cache(64)
        target.forward(ids, torch.arange(len(ids)), cache)
        past = len(ids)
        cells = []
        for rows in (1, 4):
            def body(rows=rows):
                target.forward(ids[:rows], torch.arange(past, past + rows), cache, chain=True)
                target.keep(cache, past, [])

            cells.append(median_ms(body))
        for rows in (1, 4):
            hidden = torch.randn(rows, target.hidden_size)
            cells.append(median_ms(lambda hidden=hidden: target.logits(hidden)))
        return cells

    print(f"{args.target}, {args.threads} thread(s), {torch.backends.cpu.get_cpu_capability()}")
    print("| weights | body, 1 row | body, 4 rows | head, 1 row | head, 4 rows | plain step |\n|---|---|---|---|---|---|")
    for weights in args.weights.split(","):
        cells = measure(weights)
        print(f"| {weights} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {cells[0] + cells[2]:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
