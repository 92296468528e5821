"""The interfaces of the four component families. Plugins implement them; the engine calls them.

They are structural (``typing.Protocol``): a plugin need not inherit from anything.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import attrs
import torch

from dynaspec.runtime.tree import DraftTree
from dynaspec.runtime.types import DraftStep, Shortlist


@attrs.frozen
class DecodeParams:
    """Per-generation sampling parameters (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0


@runtime_checkable
class Scheduler(Protocol):
    """``schedule budget``: how large the shortlist may be at a draft depth."""

    def budget(self, *, depth: int, scores: torch.Tensor | None = None) -> int:
        """Budget at draft depth ``depth`` (0 = first drafted token), in the scheduler's ``unit``
        (an optional attribute: "tokens" for frequency lists, "clusters" for the router), which must
        be the shortlister's ``budget_unit``. ``scores`` are the shortlister's per-row candidate
        scores when it has them (confidence-aware schedulers)."""


@runtime_checkable
class Shortlister(Protocol):
    """``propose shortlist``: the vocabulary rows the draft head scores at one step.

    A shortlister may declare three optional capabilities as attributes (read once, at build time,
    by :func:`capabilities`):

    - ``head_layout``: a permutation of the vocabulary in which its shortlists' ``spans`` are
      contiguous rows. The engine hands it to the backend's factory as ``BuildContext.head_layout``
      (None for a shortlister without one), so a blocked backend can permute the head once.
    - ``budget_unit``: what the scheduler's budget counts for it ("tokens" or "clusters"). The
      engine refuses a scheduler that declares another ``unit``.
    - ``budget_limit``: how many of that unit it has. The engine refuses a scheduler whose widest
      budget exceeds it (a sign of a unit mix-up)."""

    def propose(self, step: DraftStep, scheduler: Scheduler) -> Shortlist | Sequence[Shortlist]:
        """One shortlist shared by every row of ``step``, or one per row."""


@attrs.frozen
class ShortlisterCapabilities:
    """What a shortlister declares to the rest of the engine (see :class:`Shortlister`)."""

    head_layout: torch.Tensor | None = None
    budget_unit: str | None = None
    budget_limit: int | None = None


def capabilities(shortlister: object) -> ShortlisterCapabilities:
    """The capabilities ``shortlister`` declares (absent ones are None)."""
    return ShortlisterCapabilities(getattr(shortlister, "head_layout", None),
                                   getattr(shortlister, "budget_unit", None),
                                   getattr(shortlister, "budget_limit", None))


@runtime_checkable
class Backend(Protocol):
    """``draft-head matmul``: drafter hidden states times the shortlisted LM-head rows."""

    def logits(self, hidden: torch.Tensor, shortlist: Shortlist) -> torch.Tensor:
        """``hidden`` [R, d] -> float32 logits [R, n]; column j belongs to ``shortlist.token_ids[j]``
        (to token j when the shortlist is the full vocabulary)."""


@runtime_checkable
class Verifier(Protocol):
    """``verify``: decides what the target accepts; decides how children are drafted."""

    #: True when the drafted tree may be pruned by draft scores (EAGLE-2 rerank) without changing
    #: the output distribution. The lossless sampler needs the children it drew, as drawn.
    prunes: bool
    #: (optional) True when ``first_token`` is the argmax of the logits: the engine may then ask
    #: the target for its greedy token directly (``TargetModel.greedy_token``), which can skip
    #: a padded head product
    argmax_first_token: bool = False

    def first_token(self, logits: torch.Tensor, params: DecodeParams,
                    generator: torch.Generator) -> int:
        """The next token from full-vocabulary target logits [V]."""

    def propose(self, logits: torch.Tensor, k: int, params: DecodeParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Children to draft from draft logits [R, n]: (column indices [R, k'], their draft
        log-probabilities [R, k'], the draft distribution [R, n] they were drawn from or None)."""

    def verify(self, tree: DraftTree, logits: torch.Tensor, params: DecodeParams,
               generator: torch.Generator) -> tuple[list[int], int]:
        """Given the target's logits at the tree nodes (``logits[i]`` is node i's full-vocabulary
        row [V], computed when first read), the accepted path (node indices, root excluded) and
        the bonus token sampled at its end."""
