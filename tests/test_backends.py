"""Every draft-head backend returns the torch reference's logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from dynaspec.plugins.blocked_backend import BlockedBackend
from dynaspec.plugins.torch_backend import TorchBackend
from dynaspec.runtime import q8
from dynaspec.runtime.types import Shortlist
from dynaspec.shortlisters.router import ClusterLayout

V, D = 203, 24  # odd sizes on purpose


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def setup(request):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(V, D, generator=gen).to(request.param)
    assignment = torch.randint(0, 9, (V,), generator=gen)
    layout = ClusterLayout(assignment, 9, special=(0, 5))
    return weight, layout, request.param


def _shortlists(layout):
    yield Shortlist.full()
    yield layout.shortlist([])  # specials only
    yield layout.shortlist([3])  # one cluster
    yield layout.shortlist([0, 1, 2])  # adjacent clusters: one merged span
    yield layout.shortlist([1, 4, 8])
    yield Shortlist(torch.tensor([7, 3, 150]))  # ids without spans
    yield layout.shortlist([1, 4], context=torch.tensor([150, 7, 3, 7, 0, 99]))  # spans + gathered tail
    yield layout.shortlist([], context=torch.tensor([42]))  # the specials' span + a one-id tail


@pytest.mark.parametrize("rows", [1, 7])
def test_blocked_matches_torch(setup, rows):
    weight, layout, dtype = setup
    ref, blocked = TorchBackend(weight), BlockedBackend(weight, layout.order)
    hidden = torch.randn(rows, D, generator=torch.Generator().manual_seed(1))
    for sl in _shortlists(layout):
        a, b = ref.logits(hidden, sl), blocked.logits(hidden, sl)
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(a, b, atol=tol, rtol=tol)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert blocked.calls == ref.calls == 8


def test_blocked_without_layout_gathers(setup):
    weight, layout, _ = setup
    hidden = torch.randn(3, D)
    sl = layout.shortlist([2, 6])
    assert torch.allclose(BlockedBackend(weight, None).logits(hidden, sl), TorchBackend(weight).logits(hidden, sl))


INT8 = pytest.mark.skipif(q8.available() is not None, reason=f"int8 kernel unavailable: {q8.available()}")


@INT8
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("activations", ["auto", "float"])
def test_int8_blocked_is_the_product_of_the_int8_rows(setup, rows, ordered, activations):
    from dynaspec.plugins.int8_backend import Int8BlockedBackend

    weight, layout, dtype = setup
    backend = Int8BlockedBackend(weight, layout.order if ordered else None, activations)

    from conftest import int8_rows_reference, quantize_rows

    q, scale = quantize_rows(weight)
    reference = TorchBackend(weight)
    hidden = torch.randn(rows, D, generator=torch.Generator().manual_seed(1))
    u8 = backend.rows.int8_activations  # "auto": where AVX-512 VNNI is
    assert u8 == (activations == "auto" and "int8" in q8.modes())
    for sl in _shortlists(layout):
        got = backend.logits(hidden.to(dtype), sl)
        if sl.is_full:  # the whole vocabulary: the torch product of the head itself
            assert torch.equal(got, reference.logits(hidden.to(dtype), sl))
            continue
        ids = sl.token_ids
        want = int8_rows_reference(hidden.to(dtype), q[ids], scale[ids], u8)
        assert got.dtype == torch.float32 and got.shape == want.shape
        if u8:  # exact integer sums, then the same two float32 products
            assert torch.equal(got, want)
        else:
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)  # float32 sums of the int8 rows
        # and within the rows' (and activations') rounding of the weights' own product
        close = reference.logits(hidden.to(dtype), sl)
        assert torch.allclose(got, close, atol=0.1, rtol=0.05)
    assert backend.calls == 8
    with pytest.raises(ValueError, match="row ids outside"):
        backend.logits(hidden, Shortlist(torch.tensor([V])))


def test_auto_backend_off_cuda(registry):
    """``auto`` serves the draft head with Triton on CUDA; on a CPU with int8 rows where the
    kernel builds, else with the blocked torch product; both keep the shortlister's head layout."""
    from conftest import make_engine, reference_greedy, trained_drafter

    engine = make_engine("llama", trained_drafter("llama"), registry, backend="auto",
                         draft={"mode": "chain", "depth": 3})
    assert engine.backend.name == ("int8-blocked" if q8.available() is None else "torch-blocked")
    prompt = [4, 5, 6]
    assert engine.generate(prompt, max_new_tokens=12).token_ids == reference_greedy("llama", prompt, 12)
