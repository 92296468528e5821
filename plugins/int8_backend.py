"""The ``int8-blocked`` draft-head backend: the LM head as int8 rows (one scale each), stored once
in the shortlister's head layout, whose shortlisted rows the compiled kernel
(:class:`dynaspec.runtime.q8.Int8Rows`) multiplies in place. A draft step then reads one byte per
weight of the shortlist and copies nothing, where ``torch-blocked`` reads two (bfloat16) or four
(float32) and ``torch`` also copies the rows. With AVX-512 VNNI the activations are int8 too
(``activations``, one scale a row): one instruction per 64 products. The draft logits round
otherwise than the target's own head; drafts may differ, and verification keeps the output exact
as ever."""

from __future__ import annotations

import attrs
import torch

from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import param
from dynaspec.runtime.q8 import ROWS_ACTIVATIONS
from dynaspec.runtime.registry import Component
from dynaspec.runtime.types import BuildContext, Shortlist

from .torch_backend import TorchBackend


class Int8BlockedBackend(TorchBackend):
    """Shortlisted rows of an int8 copy of the head; the full vocabulary through ``torch``."""

    name = "int8-blocked"

    def __init__(self, weight: torch.Tensor, layout: torch.Tensor | None, activations: str = "auto") -> None:
        from dynaspec.runtime.q8 import Int8Rows

        super().__init__(weight)
        self.rows = Int8Rows(weight, order=layout, activations=activations)

    def logits(self, hidden: torch.Tensor, shortlist: Shortlist) -> torch.Tensor:
        if shortlist.token_ids is None:
            return super().logits(hidden, shortlist)
        self.calls += 1
        return self.rows.logits(hidden.reshape(-1, hidden.shape[-1]), shortlist.token_ids).reshape(
            *hidden.shape[:-1], -1)


def int8_unavailable(ctx: BuildContext) -> str | None:
    """Why ``int8-blocked`` cannot run for this target (None: it can)."""
    from dynaspec.runtime.q8 import available

    return available(ctx.device)


@attrs.frozen
class Int8Params:
    activations: str = param("auto", help="what the int8 rows multiply: int8 activations, one scale a row (AVX-512 "
                             "VNNI; the fastest), float32 ones, or auto (int8 where they run)",
                             check=lambda v: v in ROWS_ACTIVATIONS, rule="must be auto, int8 or float")


def _int8(params: Int8Params, ctx: BuildContext) -> Int8BlockedBackend:
    from dynaspec.errors import ConfigError

    problem = int8_unavailable(ctx)
    if problem is not None:
        raise ConfigError(f"backend int8-blocked cannot run here: {problem}; use torch-blocked")
    return Int8BlockedBackend(ctx.lm_head_weight, ctx.head_layout, params.activations)


@hookimpl
def dynaspec_backends():
    return [Component("int8-blocked", _int8,
                      "LM head as int8 rows in the shortlister's layout, multiplied in place by the compiled "
                      "kernel (CPU)", params=Int8Params)]
