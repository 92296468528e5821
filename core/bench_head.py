"""``dynaspec bench-head``: draft-head time against shortlist size for each GEMM backend.

Backends run interleaved (A B A B ...) on the same shortlists, and the median of the repeats is
reported. The memory-bandwidth bound is the time to read the shortlisted rows once, at the
bandwidth measured in the same run by a large tensor copy.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch

from .types import BuildContext, Shortlist


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second moved by a large copy (read + write counted)."""
    src = torch.empty(megabytes * (1 << 20) // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times)


def bench_head(weight: torch.Tensor, backends: dict[str, Any], sizes: Sequence[int], rows: Sequence[int],
               dtypes: Sequence[torch.dtype], *, repeats: int = 7, seed: int = 0) -> dict[str, Any]:
    """Median seconds per head product for every (dtype, rows, size, backend)."""
    from .registry import default_registry

    gen = torch.Generator().manual_seed(seed)
    vocab, d = weight.shape
    layout = torch.randperm(vocab, generator=gen)
    bandwidth = copy_bandwidth()
    results = []
    for dtype in dtypes:
        w = weight.detach().to(dtype).contiguous()
        ctx = BuildContext(vocab_size=vocab, hidden_size=d, lm_head_weight=w, special_token_ids=(),
                           target_fingerprint={}, head_layout=layout)
        built = {name: default_registry().build("backend", name, {}, ctx) for name in backends}
        for r in rows:
            hidden = torch.randn(r, d, generator=gen)
            for size in sizes:
                size = min(size, vocab)
                shortlist = Shortlist(layout[:size], spans=((0, size),)) if size < vocab else Shortlist.full()
                timings: dict[str, list[float]] = {name: [] for name in built}
                for _ in range(repeats):
                    for name, backend in built.items():  # interleaved: noise hits all alike
                        start = time.perf_counter()
                        backend.logits(hidden, shortlist)
                        timings[name].append(time.perf_counter() - start)
                bound = size * d * w.element_size() / (bandwidth / 2)
                for name, ts in timings.items():
                    results.append({"dtype": str(dtype).replace("torch.", ""), "rows": r, "size": size,
                                    "backend": name, "seconds": statistics.median(ts), "bound": bound})
    return {"bandwidth_bytes_per_s": bandwidth, "results": results}


def format_table(report: dict[str, Any]) -> str:
    lines = [f"copy bandwidth (read+write): {report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
             "| dtype | rows | shortlist | backend | ms (median) | bandwidth bound ms | x bound |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['dtype']} | {r['rows']} | {r['size']:,} | {r['backend']} | {r['seconds'] * 1e3:.2f} | "
                     f"{r['bound'] * 1e3:.2f} | {r['seconds'] / r['bound']:.2f} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list] = {}
    for r in report["results"]:
        groups.setdefault((r["dtype"], r["rows"], r["backend"]), []).append(r)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (dtype, rows, backend), rs in sorted(groups.items()):
        ax.plot([r["size"] for r in rs], [r["seconds"] * 1e3 for r in rs], marker="o",
                label=f"{backend} {dtype} rows={rows}")
    bounds = {(r["dtype"], r["size"]): r["bound"] for r in report["results"]}
    for dtype in sorted({k[0] for k in bounds}):
        pts = sorted((s, b) for (dt, s), b in bounds.items() if dt == dtype)
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], linestyle="--", color="gray",
                label=f"bandwidth bound {dtype}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("shortlist size (rows of the LM head)")
    ax.set_ylabel("ms per head product")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
