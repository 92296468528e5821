"""Where a generation's time goes, against what the hardware allows.

Decoding a small model is bound by memory: every target step reads all of the target's weights.
:func:`read_bandwidth` measures how fast this machine streams memory (in the same run as the
benchmark, since shared machines vary), :func:`weight_bytes` counts the target's weight bytes, and
:func:`cost_figures` turns a stack's summed statistics into per-cycle times, the cost of one
verification in plain steps, and the fraction reached of the bandwidth bound: the tokens/s a
decoder would reach if it did nothing but read the target's weights once per committed token
(plain decoding) or once per cycle (speculative decoding, with the cycle's accepted tokens).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Mapping, Sequence

from dynaspec.runtime.stats import DRAFT_KEYS


def read_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Read bandwidth of this machine in bytes/s (median of ``repeats`` full reads of a buffer far
    larger than the caches), with the current torch thread setting."""
    import torch

    buffer = torch.ones(megabytes << 18, dtype=torch.float32)  # megabytes MiB of float32
    buffer.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / statistics.median(times)


#: bytes per weight of the decoder body and of the LM head, per quantised weights setting
_WEIGHT_SIZES = {"float16": (2, 2), "int8-head": (2, 1), "int8": (1, 1), "w8a8": (1, 1)}


def weight_bytes(target) -> int:
    """Bytes of the target's weights as its ``weights`` setting stores them (a tied embedding and
    LM head counted once): the dtype's size, or 2 or 1 byte a weight for the quantised settings."""
    total = target.parameter_count
    sizes = _WEIGHT_SIZES.get(getattr(target, "weights", "dtype"))
    if sizes is None:
        return total * target.lm_head_weight.element_size()
    head = target.lm_head_weight.numel()
    return (total - head) * sizes[0] + head * sizes[1]


def cost_figures(rows: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]], *,
                 bandwidth: float, weights: int) -> dict[str, Any]:
    """Cost model of one stack from its per-prompt rows (``times``, ``accepted``, ``new_tokens``,
    ``wall``, ``verify_times``) and the baseline's rows on the same prompts."""
    tokens = sum(r["new_tokens"] for r in rows)
    committed = tokens - len(rows)  # each prompt's first token comes from its prefill, in no cycle
    cycles = sum(len(r["accepted"]) for r in rows) or max(committed, 1)
    times = {k: sum(r["times"].get(k, 0.0) for r in rows) for k in rows[0]["times"]} if rows else {}
    wall = sum(r["wall"] for r in rows)
    per_cycle = {
        "draft": sum(times.get(k, 0.0) for k in DRAFT_KEYS) / cycles,
        "target_body": times.get("target_body", 0.0) / cycles,
        "verify_head": times.get("verify_head", 0.0) / cycles,
        "bookkeeping": times.get("bookkeeping", 0.0) / cycles,
    }
    per_cycle["other"] = (wall - times.get("prefill", 0.0)) / cycles - sum(per_cycle.values())
    plain = [t for r in baseline for t in r.get("verify_times", [])]
    mine = [t for r in rows for t in r.get("verify_times", [])]
    plain_step = statistics.median(plain) if plain else 0.0
    tps = tokens / wall if wall else 0.0
    # the bound: weights read once per cycle, each cycle committing (committed / cycles) tokens
    bound = bandwidth / weights * (committed / cycles) if weights else 0.0
    return {
        "ms_per_cycle": {k: 1e3 * v for k, v in per_cycle.items()},
        "tokens_per_cycle": committed / cycles,
        "plain_step_ms": 1e3 * plain_step,
        "verify_in_plain_steps": statistics.median(mine) / plain_step if mine and plain_step else 0.0,
        "tokens_per_second": tps,
        "bound_tokens_per_second": bound,
        "fraction_of_bound": tps / bound if bound else 0.0,
    }


def format_cost_table(figures: Mapping[str, Mapping[str, Any]], *, bandwidth: float,
                      weights: int | Mapping[str, int]) -> str:
    """Markdown table of :func:`cost_figures` per stack (``weights``: the target's weight bytes,
    or per stack where stacks run the target in different dtypes)."""
    sizes = sorted(set(weights.values())) if isinstance(weights, Mapping) else [weights]
    reads = ", ".join(f"{w / 1e6:,.0f} MB (one full read {1e3 * w / bandwidth:.1f} ms)" for w in sizes)
    from dynaspec.evaluation.plots import markdown_table

    header = ["stack", "tokens/cycle", "ms per cycle: draft / target body / verification head / bookkeeping / other",
              "verification in plain steps (median)", "tokens/s", "bandwidth bound tokens/s", "fraction of bound"]
    rows = [[name, f"{f['tokens_per_cycle']:.2f}",
             " / ".join(f"{f['ms_per_cycle'][k]:.1f}" for k in ("draft", "target_body", "verify_head",
                                                                 "bookkeeping", "other")),
             f"{f['verify_in_plain_steps']:.2f}", f"{f['tokens_per_second']:.2f}",
             f"{f['bound_tokens_per_second']:.2f}", f"{f['fraction_of_bound']:.0%}"] for name, f in figures.items()]
    return f"Read bandwidth measured in this run: {bandwidth / 1e9:.1f} GB/s; target weights {reads}.\n\n" + \
        markdown_table(header, rows)
