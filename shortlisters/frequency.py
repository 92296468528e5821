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

import attrs
import torch

from dynaspec.runtime.artifacts import read_artifact, write_artifact
from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import is_text, non_negative_int, param
from dynaspec.runtime.registry import Component
from dynaspec.runtime.types import BuildContext, Shortlist

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

    budget_unit = "tokens"

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


def context_param() -> int:
    """The ``context`` parameter the shortlisters share."""
    return param(0, help="how many of the last committed tokens join the shortlist", unit="tokens",
                 check=non_negative_int, rule="must be an integer >= 0")


@attrs.frozen
class FrequencyParams:
    path: str = param(help="a frequency list: a built-in artifact name or a path (see `dynaspec "
                      "build-frequency`)", check=is_text, rule="must be a non-empty string")
    context: int = context_param()


def _frequency(params: FrequencyParams, ctx: BuildContext) -> FrequencyShortlister:
    ranked, _ = load_frequency(ctx.resolve_artifact(params.path), dict(ctx.target_fingerprint))
    return FrequencyShortlister(ranked, ctx.special_token_ids, ctx.vocab_size, context=params.context,
                                device=ctx.device)


@hookimpl
def dynaspec_shortlisters():
    return [Component("frequency", _frequency, "static top-k of a frequency ranking (FR-Spec / VocabTrim)",
                      params=FrequencyParams)]
