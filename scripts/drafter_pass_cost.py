"""What a drafter's pass over several positions costs: the prompt at a generation's first draft, or
the tokens committed since its last draft (after plain steps, or cycles another drafter drafted).
The engine needs the last position's output alone there; every position's key and value go to the
drafter's cache. Timed both ways on the stack's own drafter, as the engine runs it (on the target's
quantised kernel where the stack's weights have one), interleaved, one thread, medians:

    python scripts/drafter_pass_cost.py --stack default --positions 50 300

"every position" computes each position's output (the engine before session 29); "the last
position" computes every key and value but the queries, attention and MLP of the last position only
(``Drafter.forward(..., last=True)``), which is what the engine runs now.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="default", help="a stack whose drafter has a model")
    parser.add_argument("--positions", type=int, nargs="+", default=[50, 300])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from dynaspec.runtime.drafter import DraftCache
    from dynaspec.runtime.engine import Engine

    torch.set_num_threads(args.threads)
    engine = Engine.from_stack(args.stack)
    model = getattr(engine.source, "model", None) if engine.source is not None else None
    if model is None:
        raise SystemExit(f"stack {args.stack!r} has no drafter with a model")
    d = model.cfg.hidden_size
    width = d * len(model.feature_layers) if model.feature_layers else d
    dtype = next(model.parameters()).dtype
    print("| positions | every position, ms | the last position, ms | ratio |")
    print("|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for n in args.positions:
        emb = torch.randn(1, n, d, generator=gen).to(dtype)
        feats = torch.randn(1, n, width, generator=gen).to(dtype)
        pos = torch.arange(n)[None]
        times: dict[bool, list[float]] = {False: [], True: []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for last in (False, True):
                    cache = DraftCache(n + 1)
                    start = time.perf_counter()
                    model(emb, feats, pos, cache=cache, last=last)
                    times[last].append(time.perf_counter() - start)
        every, alone = (statistics.median(times[k]) * 1e3 for k in (False, True))
        print(f"| {n} | {every:.2f} | {alone:.2f} | {every / alone:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
