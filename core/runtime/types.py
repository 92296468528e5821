"""Value types shared by the engine and every plugin family.

They live in the core so that backends never import shortlisters, schedulers never import
shortlisters, and the engine imports none of the three.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs
import torch


@attrs.frozen(eq=False)
class Shortlist:
    """The vocabulary rows the draft head scores at one draft step.

    ``token_ids`` is a 1-D ``LongTensor`` of vocabulary ids, or ``None`` for the full vocabulary.
    Column ``j`` of the draft logits belongs to ``token_ids[j]``.

    ``spans`` optionally describes the set as contiguous ``[start, end)`` ranges of rows in a
    permuted LM-head layout (``BuildContext.head_layout``), so that a blocked backend can multiply
    slices without a gather; ``token_ids`` then lists the ids in that span order, optionally followed
    by a *tail* of scattered ids (those past the spans' total length) that a backend gathers.
    """

    token_ids: torch.Tensor | None = None
    spans: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def full(cls) -> "Shortlist":
        """The whole vocabulary."""
        return cls(None)

    @property
    def is_full(self) -> bool:
        return self.token_ids is None

    @property
    def span_length(self) -> int:
        """How many leading ``token_ids`` the spans cover (the rest is the gathered tail)."""
        return sum(b - a for a, b in self.spans) if self.spans is not None else 0

    def size(self, vocab_size: int) -> int:
        """Number of candidate tokens."""
        return vocab_size if self.token_ids is None else int(self.token_ids.numel())


@attrs.define
class DraftStep:
    """What a shortlister sees at one draft step (depth ``t``) for ``R`` rows (tree nodes).

    ``token_embeddings`` is ``E(x_t)`` and ``prev_hidden`` is ``H~_{t-1}``: exactly the pair the
    drafter consumes at this step, so a router can run beside the draft decoder layer.
    ``context`` holds the committed token ids (prompt and output so far, the root last), the same
    for every row; a shortlister may add tokens seen there (text tends to repeat its own words).
    """

    depth: int
    tokens: torch.Tensor  # [R] token ids x_t
    token_embeddings: torch.Tensor  # [R, d]
    prev_hidden: torch.Tensor  # [R, d]
    context: torch.Tensor | None = None  # [n] committed token ids, or None where unknown


@attrs.define
class BuildContext:
    """Everything a component factory may need about the target, handed over once at assembly."""

    vocab_size: int
    hidden_size: int
    lm_head_weight: torch.Tensor  # [V, d], the target's output embedding (not copied)
    special_token_ids: tuple[int, ...]  # ids the decoder needs (EOS, end of turn): never dropped
    target_fingerprint: Mapping[str, Any]
    device: torch.device = torch.device("cpu")
    tokenizer: Any = None
    #: Resolve a path or built-in artifact name to a filesystem path.
    resolve_artifact: Callable[[str], str] = str
    #: Row permutation of the LM head the shortlister's spans refer to: set by the engine in the
    #: context it gives the backend's factory (from ``Shortlister.head_layout``), else None.
    head_layout: torch.Tensor | None = None
    #: The target's ``weights`` setting (see ``StackConfig.weights``), resolved: a component with
    #: dense layers of its own (the router) may compute them on the same kernel.
    weights: str | None = None
