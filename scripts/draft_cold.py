"""What a draft step of the stack's trained drafter costs where the engine runs it: right after a
pass of the target (a decoding step over a cached prompt), when the caches hold the target's
weights and not the drafter's, its router's or torch's own code and data. Times, each after a
target pass, the drafter's step over one row and the router's proposal (the first of a cycle's,
and the one after the drafter's step), medians over ``--repeats``; and the same hot (repeated
back to back). ``--plain`` also times them with the drafter's products apart, torch's attention
and the router's torch norm (the paths before session 37), interleaved in rounds.

    python scripts/draft_cold.py --stack default --context 300 --repeats 25 --plain
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="default")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plain", action="store_true", help="also the paths before session 37")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from dynaspec.runtime.drafter import DraftCache
    from dynaspec.runtime.engine import Engine
    from dynaspec.runtime.types import DraftStep

    torch.set_num_threads(args.threads)
    engine = Engine.from_stack(args.stack)
    sources = getattr(engine.source, "sources", [engine.source])
    neural = next((s for s in sources if getattr(s, "drafting", None) is not None), None)
    if neural is None:
        raise SystemExit(f"stack {args.stack!r} has no trained drafter")
    drafting, target = neural.drafting, engine.target
    model, shortlister = drafting.drafter, drafting.shortlister
    n, d = args.context, model.cfg.hidden_size
    cache = target.new_cache(n + 8)
    ids = torch.randint(0, target.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(0))
    width = model.fuse.in_features if getattr(model, "fuse", None) is not None else d
    dcache = DraftCache(n + 8)
    emb = target.embed(ids[:n]).to(torch.bfloat16)[None]
    feats = torch.randn(1, n, width, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        target.forward(ids[:n], torch.arange(n), cache)
        model(emb, feats, torch.arange(n)[None], cache=dcache, last=True)
    base, past = dcache.length, cache.get_seq_length()

    def target_pass() -> None:
        target.forward(ids[n:], torch.tensor([n]), cache)
        target.keep(cache, past, [])  # back to the prompt alone

    layer, router = model.layer, getattr(shortlister, "router", None)
    ways = {"now": (layer.fused, layer.c_attend, getattr(router, "c_norm", None))}
    if args.plain:
        ways["before"] = (None, None, None)
    e, h = emb[:, -1:], torch.randn(1, 1, d, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    step = DraftStep(depth=0, tokens=ids[n - 1:n], token_embeddings=e[0], prev_hidden=h[0], context=ids[:n])
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for way, (fused, attend, norm) in ways.items():
                layer.fused, layer.c_attend = fused, attend
                if router is not None:
                    router.c_norm = norm
                for cold in (True, False):
                    kind = "after a target pass" if cold else "hot"
                    for _ in range(args.repeats):
                        if cold:
                            target_pass()
                        t0 = time.perf_counter()
                        shortlister.propose(step, drafting.scheduler)
                        t1 = time.perf_counter()
                        model(e, h, torch.full((1, 1), n), cache=dcache)
                        dcache.crop(base)
                        t2 = time.perf_counter()
                        shortlister.propose(step, drafting.scheduler)
                        t3 = time.perf_counter()
                        for part, seconds in (("router, first", t1 - t0), ("drafter step", t2 - t1),
                                              ("router, after the step", t3 - t2)):
                            times.setdefault((way, kind, part), []).append(seconds)
        layer.fused, layer.c_attend = ways["now"][0], ways["now"][1]
        if router is not None:
            router.c_norm = ways["now"][2]
    print(f"{args.stack}: one row after {n} positions, medians of {args.repeats * args.rounds}")
    for (way, kind, part), seconds in times.items():
        print(f"  {way:<7} {kind:<20} {part:<24} {statistics.median(seconds) * 1e3:7.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
