"""The reference draft-head backend: gather the shortlisted LM-head rows, then one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import NoParams
from dynaspec.runtime.registry import Component
from dynaspec.runtime.types import BuildContext, Shortlist


class TorchBackend:
    """``index_select`` of the shortlisted rows of the target's LM head + ``matmul``."""

    name = "torch"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        #: how many head products this backend computed (tests check the backend really ran)
        self.calls = 0

    def logits(self, hidden: torch.Tensor, shortlist: Shortlist) -> torch.Tensor:
        self.calls += 1
        hidden = hidden.to(self.weight.dtype)
        if shortlist.token_ids is None:
            return F.linear(hidden, self.weight).float()
        rows = self.weight.index_select(0, shortlist.token_ids.to(self.weight.device))
        return F.linear(hidden, rows).float()


def _torch(params: NoParams, ctx: BuildContext) -> TorchBackend:
    return TorchBackend(ctx.lm_head_weight)


@hookimpl
def dynaspec_backends():
    return [Component("torch", _torch, "index_select of shortlisted LM-head rows + matmul", params=NoParams)]
