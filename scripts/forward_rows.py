"""The target's verification pass by row count and draft shape, on this machine.

For a stack's target (its weights, dtype and forward), after a prefill of ``--context`` tokens:
the median time of the target body (the lean forward) and of the LM head over 1, 2, 4, 6 and 8
rows laid out as a chain, and as a tree (two children at the root, a line under the first), every
pass rolled back so that each starts from the same cache. What one more verified row costs is what
decides how large a draft pays.

    python scripts/forward_rows.py --stack qwen-baseline --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="qwen-baseline", help="a stack name or file: its target is timed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache before each pass")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    args = parser.parse_args(argv)

    import torch

    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.tree import DraftTree

    torch.set_num_threads(args.threads)
    target = Engine.from_stack(args.stack).target
    past = args.context
    ids = torch.randint(3, min(5000, target.vocab_size), (past,), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(past + max(args.rows) + 8)
    with torch.inference_mode():
        target.forward(ids, torch.arange(past), cache)

    def draft(rows: int, shape: str) -> DraftTree:
        tree = DraftTree.with_root(5)
        if shape == "chain":
            for i in range(rows - 1):
                tree.add(i, 10 + i, -0.1 * i)
            return tree
        first = tree.add(0, 10, -0.1)
        tree.add(0, 11, -0.2)
        for i in range(rows - 3):
            first = tree.add(first, 20 + i, -0.3 - i)
        return tree

    times: dict[tuple[int, str], list[tuple[float, float]]] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for rows in args.rows:
                for shape in ("chain", "tree"):
                    if shape == "tree" and rows < 3:
                        continue
                    tree = draft(rows, shape)
                    chain = tree.is_chain
                    start = time.perf_counter()
                    hidden = target.forward(torch.tensor(tree.tokens), past + 1 + torch.tensor(tree.depths), cache,
                                            tree_mask=None if chain else tree.attention_mask(), chain=chain and rows > 1)
                    body = time.perf_counter() - start
                    start = time.perf_counter()
                    target.logits(hidden)
                    head = time.perf_counter() - start
                    target.keep(cache, past, [])
                    times.setdefault((rows, shape), []).append((body, head))
    one = statistics.median(b for b, _ in times[(1, "chain")])
    print(f"{args.stack}: target {target.name}, weights {target.weights}, {target.dtype}, {args.threads} thread(s), "
          f"{past} tokens of context, median of {args.repeats}")
    print("| rows | shape | body, ms | head, ms | body in one-row passes |")
    print("|---|---|---|---|---|")
    for (rows, shape), values in times.items():
        body = statistics.median(b for b, _ in values)
        head = statistics.median(h for _, h in values)
        print(f"| {rows} | {shape} | {1e3 * body:.2f} | {1e3 * head:.2f} | {body / one:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
