"""``dynaspec bench-head``: draft-head time against shortlist size for each GEMM backend.

Backends run interleaved (A B A B ...) on the same shortlists, and the median of the repeats is
reported. The memory-bandwidth bound is the time to read the shortlisted rows once at the read
bandwidth measured in the same run (a sum over a 256 MiB tensor, the fastest streaming read
torch does here; a copy is measured too and reported for reference).

``draft_step_breakdown`` times whole generations of real stacks and splits their drafting time
per draft step into embed, draft core (the drafter layer), router and head GEMM.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch

from dynaspec.runtime.types import BuildContext, Shortlist


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    """Seconds for one call of ``fn``, the device's queued work included."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def copy_bandwidth(megabytes: int = 256, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Bytes per second moved by a large copy (read + write counted)."""
    device = torch.device(device)
    src = torch.empty(megabytes * (1 << 20) // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first-touch pages, lazy initialisation
    times = [_timed(lambda: dst.copy_(src), device) for _ in range(repeats)]
    return 2 * src.numel() * 4 / statistics.median(times)


def read_bandwidth(megabytes: int = 256, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Bytes per second read by a streaming reduction (what a memory-bound GEMV can reach)."""
    device = torch.device(device)
    src = torch.empty(megabytes * (1 << 20) // 4, dtype=torch.float32, device=device).uniform_()
    src.sum()
    times = [_timed(src.sum, device) for _ in range(repeats)]
    return src.numel() * 4 / statistics.median(times)


def bench_head(weight: torch.Tensor, backends: dict[str, Any], sizes: Sequence[int], rows: Sequence[int],
               dtypes: Sequence[torch.dtype], *, repeats: int = 7, seed: int = 0,
               device: str | torch.device = "cpu") -> dict[str, Any]:
    """Median seconds per head product for every (dtype, rows, size, backend), on ``device`` (the
    weights, hidden states and shortlists placed there; a GPU's queue is drained around each call)."""
    from dynaspec.runtime.registry import default_registry

    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    vocab, d = weight.shape
    layout = torch.randperm(vocab, generator=gen).to(device)
    copy_bw = copy_bandwidth(device=device)
    bandwidth = read_bandwidth(device=device)
    results = []
    for dtype in dtypes:
        w = weight.detach().to(device=device, dtype=dtype).contiguous()
        ctx = BuildContext(vocab_size=vocab, hidden_size=d, lm_head_weight=w, special_token_ids=(),
                           target_fingerprint={}, head_layout=layout)
        built = {name: default_registry().build("backend", name, {}, ctx) for name in backends}
        for r in rows:
            hidden = torch.randn(r, d, generator=gen).to(device)
            for size in sizes:
                size = min(size, vocab)
                shortlist = Shortlist(layout[:size], spans=((0, size),)) if size < vocab else Shortlist.full()
                timings: dict[str, list[float]] = {name: [] for name in built}
                for backend in built.values():  # warm-up: a GPU kernel compiles on its first call
                    backend.logits(hidden, shortlist)
                for _ in range(repeats):
                    for name, backend in built.items():  # interleaved: noise hits all alike
                        timings[name].append(_timed(lambda b=backend, h=hidden, s=shortlist: b.logits(h, s),
                                                    device))
                bound = size * d * w.element_size() / bandwidth
                for name, ts in timings.items():
                    results.append({"dtype": str(dtype).replace("torch.", ""), "rows": r, "size": size,
                                    "backend": name, "seconds": statistics.median(ts), "bound": bound})
    return {"bandwidth_bytes_per_s": bandwidth, "copy_bandwidth_bytes_per_s": copy_bw,
            "threads": torch.get_num_threads(), "device": str(device), "results": results}


def format_table(report: dict[str, Any]) -> str:
    lines = [f"read bandwidth (the bound): {report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
             f"copy bandwidth (read+write): {report.get('copy_bandwidth_bytes_per_s', 0) / 1e9:.1f} GB/s; "
             f"threads: {report.get('threads', '?')}; device: {report.get('device', 'cpu')}",
             "| dtype | rows | shortlist | backend | ms (median) | bandwidth bound ms | x bound |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['dtype']} | {r['rows']} | {r['size']:,} | {r['backend']} | {r['seconds'] * 1e3:.2f} | "
                     f"{r['bound'] * 1e3:.2f} | {r['seconds'] / r['bound']:.2f} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path) -> None:
    from dynaspec.evaluation.plots import figure

    groups: dict[tuple, list] = {}
    for r in report["results"]:
        groups.setdefault((r["dtype"], r["rows"], r["backend"]), []).append(r)
    with figure(path, size=(7.5, 4.5), xlabel="shortlist size (rows of the LM head)",
                ylabel="ms per head product", xlog=True, ylog=True, grid=True, legend=True) as ax:
        for (dtype, rows, backend), rs in sorted(groups.items()):
            ax.plot([r["size"] for r in rs], [r["seconds"] * 1e3 for r in rs], marker="o",
                    label=f"{backend} {dtype} rows={rows}")
        bounds = {(r["dtype"], r["size"]): r["bound"] for r in report["results"]}
        for dtype in sorted({k[0] for k in bounds}):
            pts = sorted((s, b) for (dt, s), b in bounds.items() if dt == dtype)
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], linestyle="--", color="gray",
                    label=f"bandwidth bound {dtype}")


STEP_KEYS = ("embed", "draft_core", "router", "head_gemm")


def draft_step_breakdown(stack_refs: Sequence[str], prompts: Sequence[str], *, max_new_tokens: int = 48,
                         overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Milliseconds per draft step in each part, for each stack, prompts interleaved across stacks.

    ``draft_core`` includes the drafter's catch-up pass over the tokens committed by the previous
    cycle, so it is the whole drafter-layer cost of a cycle spread over its steps.
    """
    from dynaspec.runtime.engine import Engine

    engines = Engine.from_stacks(stack_refs, overrides=overrides)
    totals = {e.stack.name: {"steps": 0, "times": dict.fromkeys(STEP_KEYS, 0.0), "sizes": [], "mal": []}
              for e in engines}
    for prompt in prompts:
        for engine in engines:  # interleaved, so machine noise hits every stack alike
            result = engine.generate(engine.target.format_prompt(prompt), max_new_tokens=max_new_tokens,
                                     temperature=0.0)
            agg = totals[engine.stack.name]
            agg["steps"] += result.stats.draft_steps
            for key in STEP_KEYS:
                agg["times"][key] += result.stats.times[key]
            agg["sizes"].append(result.stats.mean_shortlist_size)
            agg["mal"].append(result.stats.mean_accepted_length)
            agg["wall"] = agg.get("wall", 0.0) + result.stats.wall_time
    report: dict[str, Any] = {}
    for name, agg in totals.items():
        steps = max(agg["steps"], 1)
        per = {key: 1e3 * t / steps for key, t in agg["times"].items()}
        report[name] = {"draft_steps": agg["steps"], "ms_per_step": per, "total_ms_per_step": sum(per.values()),
                        "wall_seconds": agg.get("wall", 0.0),
                        "mean_shortlist_size": statistics.mean(agg["sizes"]) if agg["sizes"] else 0.0,
                        "mean_accepted_length": statistics.mean(agg["mal"]) if agg["mal"] else 0.0}
    first = report[engines[0].stack.name]["total_ms_per_step"] if engines else 0.0
    for f in report.values():
        f["ratio_to_first"] = f["total_ms_per_step"] / first if first else 0.0
    return report


def format_breakdown(report: dict[str, Any]) -> str:
    from dynaspec.evaluation.plots import markdown_table

    header = ["stack", "draft steps", "embed ms", "draft core ms", "router ms", "head GEMM ms", "total ms/step",
              "x first stack", "mean shortlist", "MAL"]
    return markdown_table(header, [
        [name, f["draft_steps"], *(f"{f['ms_per_step'][k]:.2f}" for k in STEP_KEYS),
         f"{f['total_ms_per_step']:.2f}", f"{f['ratio_to_first']:.3f}", f"{f['mean_shortlist_size']:,.0f}",
         f"{f['mean_accepted_length']:.2f}"] for name, f in report.items()])


def run(target_ref: str, out, *, backends: Sequence[str], sizes: Sequence[int], rows: Sequence[int],
        dtypes: Sequence[str], repeats: int, breakdown: Sequence[str] = (), breakdown_prompts: int = 4,
        breakdown_tokens: int = 48, overrides: dict[str, Any] | None = None, device: str = "cpu",
        head_shape: Sequence[int] | None = None) -> dict[str, Any]:
    """``dynaspec bench-head``: time the head per backend (and optionally whole generations), print
    the tables and write ``bench_head.json`` and ``bench_head.png`` to ``out``. ``head_shape``
    (vocabulary, hidden size) times a random head of that shape instead of the target's."""
    import json
    import sys
    from pathlib import Path

    from dynaspec.errors import ConfigError
    from dynaspec.runtime.files import atomic_write
    from dynaspec.runtime.target import check_device
    from dynaspec.runtime.targets import load_target

    check_device(device)
    if head_shape is not None:
        vocab, hidden = head_shape
        if vocab < 1 or hidden < 1:
            raise ConfigError(f"--head-shape needs two positive sizes (vocabulary, hidden), got {vocab} {hidden}")
        if breakdown:
            raise ConfigError("--breakdown times a target's stacks; it cannot run with --head-shape")
        weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * hidden ** -0.5
    else:
        weight = load_target(target_ref).lm_head_weight
    torch_dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in dtypes]
    report = bench_head(weight, backends, sizes, rows, torch_dtypes, repeats=repeats, device=device)
    report["head_shape"] = list(weight.shape)
    print(format_table(report))
    if breakdown:
        from dynaspec.evaluation.bench import parse_questions

        prompts = [q.turns[0] for q in parse_questions(None)][:breakdown_prompts]
        report["draft_step_breakdown"] = draft_step_breakdown(breakdown, prompts, max_new_tokens=breakdown_tokens,
                                                              overrides=overrides or {})
        print()
        print(format_breakdown(report["draft_step_breakdown"]))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "bench_head.json", lambda p: Path(p).write_text(json.dumps(report, indent=2)))
    plot(report, out / "bench_head.png")
    print(f"wrote {out / 'bench_head.json'} and {out / 'bench_head.png'}", file=sys.stderr)
    return report
