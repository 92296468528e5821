"""The ``triton`` draft-head backend: one fused kernel gathers the shortlisted LM-head rows and
multiplies them, so the gathered rows are never copied to memory; an optional fused epilogue
returns only the per-row maximum, its token and the log-sum-exp, so the logits are never written.

It runs on CUDA tensors. On a CPU machine its correctness tests run under Triton's interpreter
(``TRITON_INTERPRET=1``) at small shapes. When Triton or a GPU is missing the backend says why, and
selecting it explicitly fails with that reason.
"""

from __future__ import annotations

import os

import attrs
import torch

from dynaspec.errors import ConfigError
from dynaspec.runtime.hookspecs import hookimpl
from dynaspec.runtime.params import param, positive_int
from dynaspec.runtime.registry import Component
from dynaspec.runtime.types import BuildContext, Shortlist


def unavailable_reason() -> str | None:
    """Why the Triton backend cannot run here, or None when it can."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"triton is not installed ({type(exc).__name__}: {exc}); pip install 'dynaspec[triton]'"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if not torch.cuda.is_available():
        return "no CUDA GPU is available (set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"
    return None


def _kernels():
    """The kernels, compiled on first use: importing this module never imports triton."""
    from . import _triton_kernels as k

    return k.gather_gemm, k.gather_gemm_max


class TritonBackend:
    """Fused gather + GEMM over the shortlisted rows (``BLOCK_N`` ids per program)."""

    name = "triton"

    def __init__(self, weight: torch.Tensor, *, block_n: int = 128, block_d: int = 128) -> None:
        self.weight = weight.contiguous()
        self.block_n, self.block_d = block_n, block_d
        self.calls = 0
        self._ieee = weight.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
        self._all_ids: torch.Tensor | None = None

    def _ids(self, shortlist: Shortlist) -> torch.Tensor:
        if shortlist.token_ids is not None:
            return shortlist.token_ids.to(self.weight.device, torch.int32).contiguous()
        if self._all_ids is None:
            self._all_ids = torch.arange(self.weight.shape[0], device=self.weight.device, dtype=torch.int32)
        return self._all_ids

    def _launch(self, hidden: torch.Tensor, ids: torch.Tensor):
        import triton

        # the products take the weight's dtype, as the torch backend's do (float32 accumulation)
        hidden = hidden.to(self.weight.device, self.weight.dtype).contiguous()
        r, n = hidden.shape[0], ids.numel()
        block_r = max(16, min(64, triton.next_power_of_2(r)))  # tl.dot's tiles are at least 16 wide
        grid = (triton.cdiv(max(n, 1), self.block_n), triton.cdiv(r, block_r))
        return hidden, r, n, block_r, grid

    def logits(self, hidden: torch.Tensor, shortlist: Shortlist) -> torch.Tensor:
        self.calls += 1
        ids = self._ids(shortlist)
        hidden, r, n, block_r, grid = self._launch(hidden, ids)
        out = torch.empty(r, n, device=self.weight.device, dtype=torch.float32)
        if n:
            _kernels()[0][grid](hidden, self.weight, ids, out, r, n, hidden.shape[1], hidden.stride(0),
                                self.weight.stride(0), out.stride(0), BLOCK_R=block_r, BLOCK_N=self.block_n,
                                BLOCK_D=self.block_d, IEEE=self._ieee)
        return out

    def max_logit(self, hidden: torch.Tensor, shortlist: Shortlist) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused epilogue: per row (max logit, its token id, log-sum-exp) without writing logits."""
        self.calls += 1
        ids = self._ids(shortlist)
        hidden, r, n, block_r, grid = self._launch(hidden, ids)
        if n == 0:
            raise ConfigError("max_logit needs a non-empty shortlist")
        nb = grid[0]
        dev = self.weight.device
        mx = torch.empty(r, nb, device=dev, dtype=torch.float32)
        arg = torch.empty(r, nb, device=dev, dtype=torch.int32)
        lse = torch.empty(r, nb, device=dev, dtype=torch.float32)
        _kernels()[1][grid](hidden, self.weight, ids, mx, arg, lse, r, n, hidden.shape[1], hidden.stride(0),
                            self.weight.stride(0), nb, BLOCK_R=block_r, BLOCK_N=self.block_n,
                            BLOCK_D=self.block_d, IEEE=self._ieee)
        best, block = mx.max(dim=1)
        col = arg.gather(1, block[:, None])[:, 0].long()
        return best, ids.long()[col], torch.logsumexp(lse, dim=1)


def _power_of_two(value) -> bool:
    return positive_int(value) and value & (value - 1) == 0 and value >= 16


@attrs.frozen
class TritonParams:
    block_n: int = param(128, help="shortlisted rows per program", unit="rows", check=_power_of_two,
                         rule="must be a power of two >= 16")
    block_d: int = param(128, help="hidden dimensions per inner step", unit="columns", check=_power_of_two,
                         rule="must be a power of two >= 16")


def _triton(params: TritonParams, ctx: BuildContext) -> TritonBackend:
    block_n, block_d = params.block_n, params.block_d
    reason = unavailable_reason()
    if reason:
        raise ConfigError(f"backend 'triton' is unavailable: {reason}")
    weight = ctx.lm_head_weight
    if os.environ.get("TRITON_INTERPRET") != "1" and weight.device.type != "cuda":
        raise ConfigError("backend 'triton' is unavailable: the target's LM head is on the CPU "
                          "(run the target on CUDA, or set TRITON_INTERPRET=1 for slow CPU checks)")
    return TritonBackend(weight, block_n=block_n, block_d=block_d)


@hookimpl
def dynaspec_backends():
    return [Component("triton", _triton, "fused gather + GEMM kernel (CUDA; TRITON_INTERPRET=1 on CPU)",
                      params=TritonParams)]
