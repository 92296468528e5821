"""What a larger drafter would cost per draft step: the median time of one drafter forward (one new
token over a cached context, bfloat16, one thread) for the shipped drafter's architecture and wider
or deeper variants, measured interleaved in one run. Untrained weights cost what trained ones do.

    python scripts/draft_core_cost.py --drafter gemma3-270m --mlp 3072 4096 --layers 2

Prints milliseconds per step and the bf16 size of each variant.
"""

from __future__ import annotations

import argparse
import statistics
import time

import attrs
import torch

from dynaspec.runtime.drafter import DraftCache, Drafter


def _variant(cfg, layers: int) -> list[Drafter]:
    torch.manual_seed(0)
    return [Drafter(cfg).to(torch.bfloat16).eval() for _ in range(layers)]


def main() -> None:
    from dynaspec.runtime.targets import resolve_artifact

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="gemma3-270m", help="drafter artifact (name or folder)")
    parser.add_argument("--mlp", type=int, nargs="*", default=[], help="wider MLP widths to try")
    parser.add_argument("--layers", type=int, nargs="*", default=[], help="layer counts to try (stacked layers)")
    parser.add_argument("--context", type=int, default=300, help="cached positions before the step")
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = Drafter.load(resolve_artifact(args.drafter)).cfg
    variants = {f"as shipped (MLP {base.intermediate_size})": (base, 1)}
    variants.update({f"MLP {w}": (attrs.evolve(base, intermediate_size=w), 1) for w in args.mlp})
    variants.update({f"{n} stacked layers (each with its fc: an upper bound)": (base, n) for n in args.layers})
    d, n = base.hidden_size, args.context
    models, caches = {}, {}
    with torch.inference_mode():
        for name, (cfg, layers) in variants.items():
            models[name] = _variant(cfg, layers)
            caches[name] = [DraftCache(n + 8) for _ in models[name]]
            ctx = torch.randn(1, n, d, dtype=torch.bfloat16)
            for model, cache in zip(models[name], caches[name]):
                model(ctx, ctx, torch.arange(n)[None], cache=cache)
        emb, feat, pos = (torch.randn(1, 1, d, dtype=torch.bfloat16),
                          torch.randn(1, 1, d, dtype=torch.bfloat16), torch.tensor([[n]]))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):  # interleaved: a noisy machine slows every variant alike
            for name in variants:
                start = time.perf_counter()
                out = feat
                for model, cache in zip(models[name], caches[name]):
                    out = model(emb, out, pos, cache=cache)
                    cache.crop(n)
                times[name].append(time.perf_counter() - start)
    first = statistics.median(next(iter(times.values())))
    print(f"| drafter | ms per draft-layer step (median of {args.rounds}) | vs shipped | size (bf16) |")
    print("|---|---|---|---|")
    for name, t in times.items():
        size = sum(p.numel() for m in models[name] for p in m.parameters()) * 2 / 1e6
        print(f"| {name} | {statistics.median(t) * 1e3:.3f} | {statistics.median(t) / first:.2f}x | {size:.1f} MB |")


if __name__ == "__main__":
    main()
