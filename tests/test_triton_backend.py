"""The fused Triton kernel against the torch reference, under Triton's CPU interpreter."""

from __future__ import annotations

import os

import pytest
import torch

from dynaspec.errors import ConfigError
from dynaspec.plugins import triton_backend
from dynaspec.plugins.torch_backend import TorchBackend
from dynaspec.runtime.types import BuildContext, Shortlist
from dynaspec.shortlisters.router import ClusterLayout

pytest.importorskip("triton")


@pytest.fixture
def interpret():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("these checks run the kernels under Triton's CPU interpreter")


def _ctx(weight):
    return BuildContext(vocab_size=weight.shape[0], hidden_size=weight.shape[1], lm_head_weight=weight,
                        special_token_ids=(), target_fingerprint={})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5])
def test_kernel_matches_torch(interpret, dtype, rows):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(157, 40, generator=gen).to(dtype)  # odd sizes: masked tails in both dims
    backend = triton_backend.TritonBackend(weight, block_n=32, block_d=16)
    ref = TorchBackend(weight)
    hidden = torch.randn(rows, 40, generator=gen)
    layout = ClusterLayout(torch.randint(0, 5, (157,), generator=gen), 5, special=(3,))
    for sl in [Shortlist.full(), layout.shortlist([2]), layout.shortlist([0, 4]), layout.shortlist([]),
               Shortlist(torch.tensor([100, 7, 7, 156]))]:
        got, want = backend.logits(hidden, sl), ref.logits(hidden, sl)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert got.shape == want.shape and torch.allclose(got, want, atol=tol, rtol=tol)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        best, token, lse = backend.max_logit(hidden, sl)
        ids = torch.arange(157) if sl.token_ids is None else sl.token_ids
        assert torch.equal(token, ids[want.argmax(-1)])
        assert torch.allclose(best, want.max(-1).values, atol=tol, rtol=tol)
        assert torch.allclose(lse, torch.logsumexp(want, -1), atol=tol, rtol=tol)


def test_unavailable_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert "no CUDA GPU" in triton_backend.unavailable_reason()
    with pytest.raises(ConfigError, match="backend 'triton' is unavailable: no CUDA GPU"):
        triton_backend._triton(triton_backend.TritonParams(), _ctx(torch.randn(8, 4)))


def test_engine_runs_with_triton(interpret):
    from conftest import builtin_registry, make_engine, reference_greedy, trained_drafter

    registry = builtin_registry()
    engine = make_engine("llama", trained_drafter("llama"), registry, backend="triton",
                         draft={"mode": "chain", "depth": 2})
    prompt = [4, 5, 6]
    assert engine.generate(prompt, max_new_tokens=6).token_ids == reference_greedy("llama", prompt, 6)
    assert engine.backend.calls > 0 and os.environ["TRITON_INTERPRET"] == "1"
