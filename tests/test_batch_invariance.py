"""Batch-invariant target numerics (dynaspec.runtime.batch_invariance) and the bfloat16 engine path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import builtin_registry, trained_drafter
from dynaspec.plugins.tiny import tiny_target
from dynaspec.runtime.batch_invariance import _split_linear, invariant_linear, make_batch_invariant
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.engine import Engine


def _rows_equal_singles(layer: nn.Module, k: int, dtype) -> bool:
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.inference_mode():
        single = torch.cat([layer(x[i:i + 1]) for i in range(12)])
        return all(torch.equal(layer(x[:m]), single[:m]) for m in (2, 3, 4, 6, 12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_layers_compute_every_row_as_a_single_row(dtype):
    """Whatever this machine's kernels do, a layer the probe calls stock or k-split gives the same
    rows in a batch as one at a time; the verdicts name every distinct shape."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(640, 2048, bias=False), nn.Linear(2048, 640, bias=False),
                          nn.Linear(2048, 640, bias=False), nn.Linear(96, 40)).to(dtype)
    verdicts = make_batch_invariant(model)
    assert set(verdicts) == {f"2048x640 {str(dtype)[6:]}", f"640x2048 {str(dtype)[6:]}", f"40x96 {str(dtype)[6:]}"}
    for layer in model:
        shape = f"{layer.weight.shape[0]}x{layer.weight.shape[1]} {str(dtype)[6:]}"
        if verdicts[shape] != "variant":
            assert _rows_equal_singles(layer, layer.weight.shape[1], dtype), (shape, verdicts[shape])
        assert ("forward" in vars(layer)) == verdicts[shape].startswith("k-split")


def test_k_split_computes_the_same_product():
    torch.manual_seed(1)
    w, b = torch.randn(64, 256), torch.randn(64)
    x = torch.randn(5, 256)
    for parts in (2, 4, 8):
        torch.testing.assert_close(_split_linear(w, b, parts)(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert _split_linear(w, b, 3) is None  # 256 does not split in 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_reports_a_usable_verdict(dtype):
    """Without padding: stock, a K-split or variant, and what is not variant computes every row as
    a single row. With padding (the lean forward's products) nothing is left variant on a machine
    whose kernels are deterministic per shape, and every row is a single row's."""
    w = torch.randn(32, 128).to(dtype)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    for pad in (False, True):
        verdict, fn = invariant_linear(w, pad=pad)
        assert verdict in ("stock", "variant") or verdict.startswith(("k-split", "pad") if pad else "k-split")
        assert (fn is not None) == verdict.startswith(("k-split", "pad"))
        if pad:
            assert verdict != "variant"
        if verdict != "variant":
            product = fn or (lambda v: F.linear(v, w))
            single = torch.cat([product(x[i:i + 1]) for i in range(9)])
            assert all(torch.equal(product(x[:m]), single[:m]) for m in range(2, 10)), verdict


@pytest.mark.parametrize("draft", [{"mode": "chain", "depth": 5}, {"mode": "tree", "depth": 3, "topk": 2,
                                                                    "total_tokens": 6}])
def test_bfloat16_speculation_equals_bfloat16_plain_decoding(draft):
    """The engine in bfloat16, after make_batch_invariant: greedy speculative output equals the same
    target's plain greedy output, token for token, on every prompt."""
    tgt = tiny_target("gemma3").to(dtype=torch.bfloat16)
    verdicts = tgt.make_batch_invariant()
    assert tgt.batch_invariant == (not tgt.variant_products())
    # the lean forward's products and the head are split or padded where needed: never left variant
    assert tgt.batch_invariant, verdicts
    drafter = trained_drafter("gemma3")  # shared with other tests: cast a copy
    spec = Engine(stack_from_mapping({"name": "s", "target": "tiny-gemma3", "drafter": "x", "draft": draft,
                                      "dtype": "bfloat16"}), tgt, _bf16_copy(drafter), registry=builtin_registry())
    # plain decoding on the same kernels as the stack (a tree is "observed": relaxed kernels)
    plain = Engine(stack_from_mapping({"name": "b", "target": "tiny-gemma3", "dtype": "bfloat16",
                                       "exact": spec.stack.exact}), tgt, None, registry=builtin_registry())
    # a tree is guaranteed on the lean forward too (each row attends over its own line), on the
    # relaxed kernels its "observed" runs where no product needed padding
    relaxed_ok = not tgt.variant_products(strict=False)
    assert spec.exactness == ("guaranteed" if draft["mode"] == "chain" or relaxed_ok else "not guaranteed")
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        prompt = torch.randint(3, 99, (6,), generator=gen).tolist()
        assert spec.generate(prompt, max_new_tokens=30).token_ids == plain.generate(prompt, max_new_tokens=30).token_ids


def _bf16_copy(drafter):
    import copy

    return copy.deepcopy(drafter).to(torch.bfloat16)


def test_verdicts_are_remembered_per_machine(monkeypatch, tmp_path):
    """The probe runs once per machine and shape; later loads read its verdict."""
    from dynaspec.runtime import batch_invariance as bi

    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DYNASPEC_VERDICTS_FILE")  # the user's default place: the cache root
    calls = []
    real = bi.probe_linear
    monkeypatch.setattr(bi, "probe_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    first = bi.invariant_linear(w)
    second = bi.invariant_linear(w)
    assert first[0] == second[0] and len(calls) == 1
    assert (tmp_path / bi.VERDICTS_FILE).exists()
