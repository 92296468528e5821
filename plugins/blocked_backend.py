"""The ``torch-blocked`` draft-head backend: the LM-head rows are permuted once, at assembly, into
the shortlister's head layout (clusters, or a frequency ranking, made contiguous), so a shortlist of
whole clusters is a few contiguous slices multiplied in place — no gather copy of the rows. A
shortlist's scattered tail (e.g. tokens seen in the context) is gathered from the unpermuted head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import NoParams
from dynaspec.runtime.registry import Component
from dynaspec.runtime.types import BuildContext, Shortlist

from .torch_backend import TorchBackend


class BlockedBackend(TorchBackend):
    """Slices of a permuted copy of the LM head; the torch gather for shortlists without spans."""

    name = "torch-blocked"

    def __init__(self, weight: torch.Tensor, layout: torch.Tensor | None) -> None:
        super().__init__(weight)
        # one permuted copy (same size as the head); without a layout the head is used as is
        self.blocked = weight if layout is None else weight.index_select(0, layout.to(weight.device)).contiguous()
        self.has_layout = layout is not None

    def logits(self, hidden: torch.Tensor, shortlist: Shortlist) -> torch.Tensor:
        if shortlist.token_ids is None or shortlist.spans is None or not self.has_layout:
            return super().logits(hidden, shortlist)
        self.calls += 1
        hidden = hidden.to(self.weight.dtype)
        parts = [F.linear(hidden, self.blocked[a:b]) for a, b in shortlist.spans]
        covered = shortlist.span_length
        if shortlist.token_ids.numel() > covered:  # a tail of scattered ids: gathered
            tail = shortlist.token_ids[covered:].to(self.weight.device)
            parts.append(F.linear(hidden, self.weight.index_select(0, tail)))
        if len(parts) == 1:
            return parts[0].float()
        # logits are R x n floats: concatenating them costs nothing next to reading the rows
        return torch.cat(parts, dim=1).float()


def _blocked(params: NoParams, ctx: BuildContext) -> BlockedBackend:
    return BlockedBackend(ctx.lm_head_weight, ctx.head_layout)


def _auto(params: NoParams, ctx: BuildContext):
    """``triton`` where the target runs on CUDA and Triton is installed; on a CPU ``int8-blocked``
    where its kernel builds (it reads half the bytes of bfloat16 rows, a quarter of float32's, and
    runs a shortlist of scattered clusters in one call); else ``torch-blocked``."""
    if torch.device(ctx.device).type == "cuda":
        from .triton_backend import TritonBackend, unavailable_reason

        if unavailable_reason() is None:
            return TritonBackend(ctx.lm_head_weight)
    from .int8_backend import Int8BlockedBackend, int8_unavailable

    if int8_unavailable(ctx) is None:
        return Int8BlockedBackend(ctx.lm_head_weight, ctx.head_layout)
    return BlockedBackend(ctx.lm_head_weight, ctx.head_layout)


@hookimpl
def dynaspec_backends():
    return [Component("torch-blocked", _blocked,
                      "LM head permuted once into the shortlister's layout; contiguous slices, no gather",
                      params=NoParams),
            Component("auto", _auto, "triton on CUDA (when installed), int8-blocked on a CPU where its kernel "
                      "builds, torch-blocked elsewhere", params=NoParams)]
