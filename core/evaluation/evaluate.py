"""``dynaspec eval``: the standard dev protocol — acceptance, exactness and speed of stacks, side by
side on the same prompts.

Protocol: the first human turn of the first 40 conversations of the ShareGPT dev split,
cut to 1,500 characters, wrapped in the target's prompt format, 64 new tokens, greedy.
The ``baseline`` stack runs on every prompt too, interleaved with the others (prompt by prompt),
so machine noise hits all stacks alike; every greedy stack's output must equal the baseline's.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from dynaspec.errors import ConfigError, InputError
from dynaspec.evaluation.degenerate import is_degenerate, repeat_fraction
from dynaspec.runtime.engine import Engine
from dynaspec.runtime.stats import format_acceptance
from dynaspec.training.data import SELECTION_OFFSET, SLICES, dev_protocol_prompts


def evaluate(stacks: Sequence[str], *, prompts: int = 40, max_new_tokens: int = 64,
             max_chars: int = 1500, overrides: dict[str, Any] | None = None,
             target=None, progress: bool = True, part: tuple[int, int] = (0, 1), split: str = "dev",
             train_offset: int | None = None, slice_name: str | None = None, temperature: float = 0.0,
             seed: int = 0) -> dict[str, Any]:
    """Run ``baseline`` and ``stacks`` on the dev protocol; return per-stack, per-slice figures.

    ``part=(k, n)`` runs only prompts ``k, k+n, k+2n, ...`` (for parallel processes; see
    :func:`merge`). ``split="train"`` takes the same protocol on train prompts ``train_offset``
    (default :data:`~dynaspec.training.data.SELECTION_OFFSET`)
    onwards instead: the place to tune settings, which must never be tuned on dev.
    ``temperature > 0`` samples (prompt ``i`` with seed ``seed + i`` in every stack); sampled
    outputs are not compared token for token (``exact`` is None), only their speed and acceptance."""
    import itertools

    from tqdm import tqdm

    from dynaspec.training.data import training_prompts

    if train_offset is None:
        train_offset = SELECTION_OFFSET
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
    from dynaspec.evaluation.cost_model import read_bandwidth, weight_bytes

    engines, reference_of = build_engines(stacks, overrides, target)
    bandwidth = read_bandwidth()
    names = list(engines)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for k, item in enumerate(tqdm(items, desc="eval", unit="prompt", file=sys.stderr, disable=not progress)):
        references: dict[str, list[int]] = {}
        for name in names:  # every baseline comes before the stacks it is the reference of
            prompt = engines[name].target.format_prompt(item["text"])  # each target in its own format
            result = engines[name].generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                            seed=seed + part[0] + k * part[1])
            if reference_of[name] == name:
                references[name] = result.token_ids
            exact = result.token_ids == references[reference_of[name]] if temperature == 0 else None
            rows[name].append({"id": item["id"], "slice": item["slice"], "exact": exact,
                               "token_ids": result.token_ids, **result_row(result.stats),
                               "repeat_fraction": repeat_fraction(result.prompt_ids, result.token_ids)})
    return {"protocol": {"prompts": len(items), "max_new_tokens": max_new_tokens, "max_chars": max_chars,
                         "temperature": temperature, "seed": seed,
                         "split": split, **({"train_offset": train_offset} if split == "train" else {}),
                         **({"slice": slice_name} if slice_name else {})},
            "stacks": {name: summarize(rows[name], rows[reference_of[name]]) for name in names},
            "baselines": reference_of,
            "exactness_reasons": {name: engines[name].exactness_reason for name in names},
            "machine": {"read_bandwidth": bandwidth,
                        "weight_bytes": {n: weight_bytes(engines[n].target) for n in names}},
            "cost": costs(rows, reference_of, bandwidth,
                          {n: weight_bytes(engines[n].target) for n in names}),
            "rows": rows}


def build_engines(stacks: Sequence[str], overrides: dict[str, Any] | None,
                  target=None) -> tuple[dict[str, Engine], dict[str, str]]:
    """Engines for ``stacks`` and for the plain-decoding baseline each is measured against: one
    baseline per target, dtype, device and weights setting among the stacks (named ``baseline``,
    or ``baseline-<dtype>-<device>`` (``baseline-<target>-<dtype>-<device>`` across targets, with
    the weights and the exactness setting added where two would otherwise share a name) when the
    stacks differ), sharing one loaded target per target, dtype, device and weights. Returns the
    engines, baselines first, and each engine's reference baseline."""
    from dynaspec.runtime.numerics import stack_dtype
    from dynaspec.runtime.registry import default_registry
    from dynaspec.runtime.stacks import resolve_stack

    configs = [resolve_stack(ref, overrides=overrides) for ref in stacks if ref != "baseline"]
    if not configs:
        configs = [resolve_stack("baseline", overrides=overrides)]
    # one plain decoding per target, dtype, device, weights and exactness setting: a stack is
    # exact against plain decoding on its own weights, and an "observed" stack runs the relaxed
    # kernels, so its own plain decoding does too
    kind_of = {c.name: (c.target, str(stack_dtype(c)).removeprefix("torch."), c.device, c.weights, c.exact)
               for c in configs}
    kinds = sorted(set(kind_of.values()))
    several_targets = len({k[0] for k in kinds}) > 1

    def baseline_name(kind: tuple[str, str, str, str, str]) -> str:
        if len(kinds) == 1:
            return "baseline"
        parts = [*([Path(kind[0]).name] if several_targets else []), kind[1], kind[2]]
        # the weights and the exactness setting only where two baselines would otherwise share a name
        same_place = [k for k in kinds if k[:3] == kind[:3]]
        if len({k[3] for k in same_place}) > 1:
            parts.append(kind[3])
        if len({k[4] for k in same_place if k[3] == kind[3]}) > 1:
            parts.append(kind[4])
        return "-".join(["baseline", *parts])

    names = {kind: baseline_name(kind) for kind in kinds}
    baselines = [resolve_stack("baseline", overrides={"target": target_ref, "dtype": dtype, "device": device,
                                                      "weights": weights, "exact": exact})
                 for target_ref, dtype, device, weights, exact in kinds]
    if len(set(c.name for c in configs)) < len(configs):
        raise ConfigError("a stack is listed twice")
    registry = default_registry()
    for config in configs:  # unknown components fail here, before any model loads
        registry.check_stack(config)
    built = Engine.from_stacks([*baselines, *configs], target=target)
    engines = {names[kind]: engine for kind, engine in zip(kinds, built)}
    engines.update({c.name: engine for c, engine in zip(configs, built[len(kinds):])})
    reference_of = {name: name for name in names.values()}
    reference_of.update({c.name: names[kind_of[c.name]] for c in configs})
    return engines, reference_of


def result_row(stats) -> dict[str, Any]:
    """The per-prompt figures a report keeps of one generation."""
    return {"accepted": stats.accepted_lengths, "new_tokens": stats.new_tokens,
            "shortlist": stats.mean_shortlist_size, "wall": stats.wall_time,
            "tps": stats.tokens_per_second, "times": dict(stats.times),
            "draft_steps": stats.draft_steps, "verify_products": stats.verify_products,
            "verify_times": [round(t, 6) for t in stats.verify_times], "exactness": stats.exactness,
            "drafted_at": list(stats.drafted_at), "accepted_at": list(stats.accepted_at)}


def acceptance_per_position(rows: Sequence[dict[str, Any]]) -> list[float]:
    """Over the generations ``rows`` (see :func:`result_row`), for each draft position the fraction
    of the drafts reaching it whose token there was accepted."""
    drafted: list[int] = []
    accepted: list[int] = []
    for row in rows:
        for total, counts in ((drafted, row.get("drafted_at", ())), (accepted, row.get("accepted_at", ()))):
            total.extend([0] * (len(counts) - len(total)))
            for p, c in enumerate(counts):
                total[p] += c
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]



def merge(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report from the parts of a run split with ``part``; refuses parts that are not eval
    reports, or that ran other stacks or another protocol (other than the prompts each took)."""
    if not reports:
        raise InputError("nothing to merge: name the parts' reports (--json-out of each part)")
    for i, rep in enumerate(reports):
        if not isinstance(rep, dict) or not {"rows", "protocol"} <= rep.keys():
            raise InputError(f"part {i + 1} is not a `dynaspec eval --json-out` report")

    def protocol_of(rep):
        return {k: v for k, v in rep["protocol"].items() if k not in ("prompts", "part")}

    for i, rep in enumerate(reports[1:], start=2):
        if list(rep["rows"]) != list(reports[0]["rows"]):
            raise InputError(f"part {i} ran the stacks {list(rep['rows'])}, part 1 {list(reports[0]['rows'])}: "
                             "the parts of one run must run the same stacks")
        if protocol_of(rep) != protocol_of(reports[0]):
            raise InputError(f"part {i} ran another protocol than part 1 ({protocol_of(rep)} against "
                             f"{protocol_of(reports[0])})")
    names = list(reports[0]["rows"])
    reference_of = reports[0].get("baselines") or {n: "baseline" for n in names}
    rows = {name: [r for rep in reports for r in rep["rows"][name]] for name in names}
    protocol = dict(reports[0]["protocol"], prompts=sum(rep["protocol"]["prompts"] for rep in reports))
    out = {"protocol": protocol,
           "stacks": {n: summarize(rows[n], rows[reference_of[n]]) for n in names},
           "baselines": reference_of, "rows": rows}
    machines = [rep["machine"] for rep in reports if "machine" in rep]
    if machines:  # parts ran side by side: their bandwidths are one machine's, averaged
        bandwidth = statistics.fmean(m["read_bandwidth"] for m in machines)
        out["machine"] = {"read_bandwidth": bandwidth, "weight_bytes": machines[0]["weight_bytes"]}
        out["cost"] = costs(rows, reference_of, bandwidth, machines[0]["weight_bytes"])
    return out


def costs(rows: dict[str, list[dict[str, Any]]], reference_of: dict[str, str], bandwidth: float,
          weights: dict[str, int]) -> dict[str, Any]:
    """:func:`dynaspec.evaluation.cost_model.cost_figures` of every engine against its baseline."""
    from dynaspec.evaluation.cost_model import cost_figures

    return {n: cost_figures(rows[n], rows[reference_of[n]], bandwidth=bandwidth, weights=weights[n])
            for n in rows}


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
            # None: sampled, not compared token for token
            "exact": None if any(rows[i]["exact"] is None for i in pick) else all(rows[i]["exact"] for i in pick),
            "exactness": exactness_of([rows[i] for i in pick]),
            "mean_accepted_length": sum(accepted) / len(accepted) if accepted else 0.0,
            "acceptance_per_position": acceptance_per_position([rows[i] for i in pick]),
            # outputs repeating half their 4-grams or more (dynaspec.evaluation.degenerate)
            "degenerate": sum(is_degenerate(rows[i].get("repeat_fraction", 0.0)) for i in pick),
            "mean_shortlist_size": statistics.fmean(rows[i]["shortlist"] for i in pick),
            "tokens_per_second_median": statistics.median(rows[i]["tps"] for i in pick),
            "speedup_median": statistics.median(ratios) if ratios else 0.0,
        }
    return out


def exactness_of(rows: list[dict[str, Any]]) -> str:
    """``guaranteed`` (the engine's numerics verdict held for every generation), ``observed`` (not
    guaranteed, but every greedy output equalled plain decoding), or ``not guaranteed``."""
    if rows and all(r.get("exactness") == "guaranteed" for r in rows):
        return "guaranteed"
    if rows and all(r["exact"] is True for r in rows):
        return "observed"
    return "not guaranteed"


def format_table(report: dict[str, Any]) -> str:
    lines = ["| stack | slice | prompts | exact | exactness | mean accepted length | acceptance per draft position | mean shortlist | tokens/s (median) | speed-up vs baseline (median) | degenerate outputs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, per_slice in report["stacks"].items():
        for slice_name, f in per_slice.items():
            exact = {True: "yes", False: "NO", None: "(sampled)"}[f["exact"]]
            lines.append(f"| {name} | {slice_name} | {f['prompts']} | {exact} | {f.get('exactness', '')} | "
                         f"{f['mean_accepted_length']:.3f} | {format_acceptance(f.get('acceptance_per_position', ()))} | "
                         f"{f['mean_shortlist_size']:,.0f} | "
                         f"{f['tokens_per_second_median']:.2f} | {f['speedup_median']:.2f}x | {f.get('degenerate', '-')} |")
    return "\n".join(lines)
