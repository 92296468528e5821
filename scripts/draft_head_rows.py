"""What the draft head's shortlisted int8 rows cost (``int8-blocked``), by activations: int8
(``q8_rows_u8``, AVX-512 VNNI) against float32 (``q8_rows``), for a shortlist of whole clusters
(runs of contiguous rows at random places in the head, as the DynaSpec router picks them) and a
few drafted rows. Medians over ``--repeats`` calls, hot (back to back) and cold (each after reading
``--flush`` MB, as a draft step runs after the target's pass has streamed its weights).

    python scripts/draft_head_rows.py --target qwen2.5-coder-0.5b --rows 1 3 9
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-0.5b", help="a built-in target: its LM head is used")
    parser.add_argument("--clusters", type=int, default=50, help="clusters in the shortlist")
    parser.add_argument("--cluster-size", type=int, default=150, help="rows per cluster")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 3, 9], help="drafted rows per call")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--flush", type=int, default=600, help="MB read between cold calls")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from dynaspec.runtime import q8
    from dynaspec.runtime.targets import load_target

    torch.set_num_threads(args.threads)
    if q8.available() is not None:
        raise SystemExit(f"the int8 kernel is unavailable here: {q8.available()}")
    head = load_target(args.target).lm_head_weight.detach()
    vocab, width = head.shape
    ways = {"float": q8.Int8Rows(head, activations="float")}
    if "int8" in q8.modes():
        ways["int8"] = q8.Int8Rows(head, activations="int8")
    gen = torch.Generator().manual_seed(0)
    starts = torch.randperm(vocab // args.cluster_size, generator=gen)[:args.clusters] * args.cluster_size
    ids = torch.cat([torch.arange(s, s + args.cluster_size) for s in starts.tolist()])
    flush = torch.ones(args.flush * 2**20 // 4)
    print(f"{args.target}: {ids.numel():,} shortlisted rows of {width}, {args.threads} thread(s), "
          f"medians of {args.repeats}")
    print("| drafted rows | state | " + " | ".join(f"{name} activations ms" for name in ways) + " |")
    print("|---|---|" + "---|" * len(ways))
    for rows in args.rows:
        x = torch.randn(rows, width, generator=gen)
        for state in ("hot", "cold"):
            times = {name: [] for name in ways}
            for _ in range(args.repeats):
                for name, table in ways.items():  # interleaved
                    if state == "cold":
                        flush.sum()
                    started = time.perf_counter()
                    table.logits(x, ids)
                    times[name].append(time.perf_counter() - started)
            cells = " | ".join(f"{statistics.median(t) * 1e3:.3f}" for t in times.values())
            print(f"| {rows} | {state} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
