"""What a prompt's prefill costs the first time the process meets its length, and again.

For each length, a prompt of that many tokens (the start of README.md, in the target's prompt
format's tokens) is prefilled twice in a row by the stack's engine, new lengths in increasing
order; the first pass is what a new request of that length pays. Session 33 found the first pass
of each length ~20% slower (every int8 product kept scratch per row count: fresh pages, and
memory that grew with every length a server met); since then the two agree.

    python scripts/prefill_lengths.py --stack qwen-baseline --lengths 201 257 333 --threads 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="qwen-baseline")
    parser.add_argument("--lengths", type=int, nargs="+", default=[201, 257, 333])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from dynaspec import Engine

    torch.set_num_threads(args.threads)
    engine = Engine.from_stack(args.stack)
    target = engine.target
    ids = engine.encode((Path(__file__).resolve().parents[1] / "README.md").read_text())
    if max(args.lengths) > len(ids):
        parser.error(f"README.md holds {len(ids)} tokens; the longest length asked is {max(args.lengths)}")
    engine._prefill(torch.tensor(ids[:16]), target.new_cache(24))  # the process's own first pass
    print("| prompt tokens | first prefill of this length, ms | the same again, ms |")
    print("|---|---|---|")
    for n in sorted(args.lengths):
        x, seconds = torch.tensor(ids[:n]), []
        for _ in range(2):
            cache = target.new_cache(n + 8)
            start = time.perf_counter()
            engine._prefill(x, cache)
            seconds.append(time.perf_counter() - start)
        print(f"| {n} | {seconds[0] * 1e3:.1f} | {seconds[1] * 1e3:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
