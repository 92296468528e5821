"""``dynaspec eval``: the standard dev protocol — acceptance, exactness and speed of stacks, side by
side on the same prompts.

Protocol (DESIGN.md): the first human turn of the first 40 conversations of the ShareGPT dev split,
cut to 1,500 characters, wrapped by :func:`dynaspec.data.format_prompt`, 64 new tokens, greedy.
The ``baseline`` stack runs on every prompt too, interleaved with the others (prompt by prompt),
so machine noise hits all stacks alike; every greedy stack's output must equal the baseline's.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any, Sequence

from .data import SLICES, dev_protocol_prompts, format_prompt
from .engine import Engine


def evaluate(stacks: Sequence[str], *, prompts: int = 40, max_new_tokens: int = 64,
             max_chars: int = 1500, overrides: dict[str, Any] | None = None,
             target=None, progress: bool = True, part: tuple[int, int] = (0, 1), split: str = "dev",
             train_offset: int = 10000, slice_name: str | None = None) -> dict[str, Any]:
    """Run ``baseline`` and ``stacks`` on the dev protocol; return per-stack, per-slice figures.

    ``part=(k, n)`` runs only prompts ``k, k+n, k+2n, ...`` (for parallel processes; see
    :func:`merge`). ``split="train"`` takes the same protocol on train prompts ``train_offset``
    onwards instead: the place to tune settings, which must never be tuned on dev."""
    import itertools

    from tqdm import tqdm

    from .data import training_prompts

    if split == "dev":
        source = iter(dev_protocol_prompts(1 << 30 if slice_name else prompts, max_chars))
    elif split == "train":
        source = itertools.islice(training_prompts(max_chars), train_offset, None)
    else:
        raise ValueError(f"split must be 'dev' or 'train', got {split!r}")
    if slice_name is not None:
        source = (item for item in source if item["slice"] == slice_name)
    pool = list(itertools.islice(source, prompts))
    items = pool[part[0]::part[1]]
    engines: dict[str, Engine] = {}
    for ref in ["baseline", *[s for s in stacks if s != "baseline"]]:
        engine = Engine.from_stack(ref, overrides=overrides if ref != "baseline" else None, target=target)
        engines[engine.stack.name] = engine
        target = engine.target
    names = list(engines)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for item in tqdm(items, desc="eval", unit="prompt", file=sys.stderr, disable=not progress):
        prompt = format_prompt(item["text"])
        reference = None
        for name in names:
            result = engines[name].generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0)
            if reference is None:
                reference = result.token_ids
            s = result.stats
            rows[name].append({"id": item["id"], "slice": item["slice"], "exact": result.token_ids == reference,
                               "accepted": s.accepted_lengths, "new_tokens": s.new_tokens,
                               "shortlist": s.mean_shortlist_size, "wall": s.wall_time,
                               "tps": s.tokens_per_second, "times": dict(s.times)})
    return {"protocol": {"prompts": len(items), "max_new_tokens": max_new_tokens, "max_chars": max_chars,
                         "split": split, **({"train_offset": train_offset} if split == "train" else {}),
                         **({"slice": slice_name} if slice_name else {})},
            "stacks": {name: summarize(rows[name], rows["baseline"]) for name in names},
            "rows": rows}


def merge(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report from the parts of a run split with ``part``."""
    names = list(reports[0]["rows"])
    rows = {name: [r for rep in reports for r in rep["rows"][name]] for name in names}
    protocol = dict(reports[0]["protocol"], prompts=sum(rep["protocol"]["prompts"] for rep in reports))
    return {"protocol": protocol, "stacks": {n: summarize(rows[n], rows["baseline"]) for n in names},
            "rows": rows}


def summarize(rows: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for slice_name in ("overall", *SLICES):
        pick = [i for i, r in enumerate(rows) if slice_name == "overall" or r["slice"] == slice_name]
        if not pick:
            continue
        accepted = [a for i in pick for a in rows[i]["accepted"]]
        ratios = [rows[i]["tps"] / baseline[i]["tps"] for i in pick if baseline[i]["tps"] > 0]
        out[slice_name] = {
            "prompts": len(pick),
            "exact": all(rows[i]["exact"] for i in pick),
            "mean_accepted_length": sum(accepted) / len(accepted) if accepted else 0.0,
            "mean_shortlist_size": statistics.fmean(rows[i]["shortlist"] for i in pick),
            "tokens_per_second_median": statistics.median(rows[i]["tps"] for i in pick),
            "speedup_median": statistics.median(ratios) if ratios else 0.0,
        }
    return out


def format_table(report: dict[str, Any]) -> str:
    lines = ["| stack | slice | prompts | exact | mean accepted length | mean shortlist | tokens/s (median) | speed-up vs baseline (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, per_slice in report["stacks"].items():
        for slice_name, f in per_slice.items():
            lines.append(f"| {name} | {slice_name} | {f['prompts']} | {'yes' if f['exact'] else 'NO'} | "
                         f"{f['mean_accepted_length']:.3f} | {f['mean_shortlist_size']:,.0f} | "
                         f"{f['tokens_per_second_median']:.2f} | {f['speedup_median']:.2f}x |")
    return "\n".join(lines)
