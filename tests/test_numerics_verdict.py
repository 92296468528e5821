"""The numerics verdict: probed on every engine, padded where no K-split helps, enforced by the
stack's ``exact`` field, and reported in the statistics, ``eval`` and ``generate``."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from conftest import builtin_registry, make_engine, trained_drafter
from dynaspec.errors import ConfigError
from dynaspec.plugins.tiny import tiny_target
from dynaspec.runtime import batch_invariance as bi
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.engine import Engine


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Verdicts go to a temporary cache, never the user's."""
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))


def _one_row_kernel(x, weight, bias=None):
    """A kernel that computes one row otherwise than several (as a library's matrix-vector
    product does): its single rows are off by 1/64, so no K-split can make it invariant."""
    # each row on its own (invariant by construction, whatever this machine's kernels do)
    out = torch.cat([F.linear(x[..., i:i + 1, :], weight, bias) for i in range(x.shape[-2])], dim=-2)
    return out + 2.0 ** -6 if x.shape[-2] == 1 else out


def test_probe_pads_where_no_k_split_helps(monkeypatch):
    weight = torch.randn(48, 32)
    monkeypatch.setattr(bi, "F", types.SimpleNamespace(linear=_one_row_kernel))
    assert bi.probe_linear(weight)[0] == "variant"  # without padding nothing helps
    verdict, fn = bi.probe_linear(weight, pad=True)
    assert verdict == "pad 2"
    x = torch.randn(7, 32)
    one = torch.cat([fn(x[i:i + 1]) for i in range(7)])
    assert torch.equal(fn(x), one)  # every row as in a batch of several
    assert not torch.equal(_one_row_kernel(x[:1], weight), fn(x[:1]))


def test_verdict_key_holds_threads_and_cpu_capability():
    before = torch.get_num_threads()
    key = bi._machine()
    assert f"threads{before}" in key and torch.backends.cpu.get_cpu_capability() in key
    torch.set_num_threads(before + 1)
    try:
        assert bi._machine() != key
    finally:
        torch.set_num_threads(before)


def test_engines_probe_and_report_their_verdict():
    """Any engine, however built, probes its target; a chain on the lean forward is guaranteed
    (padded where the machine needs it), and its statistics and JSON say so."""
    tgt = tiny_target("llama", seed=7)
    assert tgt.batch_invariance is None
    stack = stack_from_mapping({"name": "t", "target": "tiny-llama", "drafter": "in-memory",
                                "draft": {"mode": "chain", "depth": 4}})
    engine = Engine(stack, tgt, trained_drafter("llama"), registry=builtin_registry())
    assert tgt.batch_invariance is not None
    assert engine.exactness == "guaranteed", engine.exactness_reason
    assert not tgt.variant_products()
    result = engine.generate([5, 6, 7, 8], max_new_tokens=12)
    assert result.stats.exactness == "guaranteed"
    assert result.to_json()["exactness"] == "guaranteed"
    plain = Engine(stack_from_mapping({"name": "p", "target": "tiny-llama"}), tgt, None, registry=builtin_registry())
    assert plain.generate([5, 6, 7, 8], max_new_tokens=12).token_ids == result.token_ids


def test_required_refuses_what_is_not_guaranteed_and_observed_reports_it(monkeypatch):
    from dynaspec.runtime.target import TargetModel

    registry = builtin_registry()
    drafter = trained_drafter("llama")
    tree_draft = {"mode": "tree", "depth": 3, "topk": 2, "total_tokens": 6}
    # on the generic forward a tree's masked attention is not a plain step's: refused when required
    generic = tiny_target("llama", seed=0)
    generic = TargetModel(generic.model, generic.tokenizer, forward="generic")
    stack = {"name": "t", "target": "tiny-llama", "drafter": "in-memory", "draft": tree_draft}
    with pytest.raises(ConfigError, match="not guaranteed here: a tree.*generic forward"):
        Engine(stack_from_mapping({**stack, "exact": "required"}), generic, drafter, registry=registry)
    observed_tree = Engine(stack_from_mapping(stack), generic, drafter, registry=registry)
    assert observed_tree.stack.exact == "observed"  # what a tree stack that does not say gets
    assert observed_tree.exactness == "not guaranteed"
    assert observed_tree.generate([5, 6, 7], max_new_tokens=8).stats.exactness == "not guaranteed"
    # on the lean forward each tree row attends over its own line: guaranteed, and equal to plain
    tree = make_engine("llama", drafter, registry, draft=tree_draft, exact="required")
    assert tree.exactness == "guaranteed", tree.exactness_reason
    assert "tree's rows attend each over its own line" in tree.exactness_reason
    plain = make_engine("llama", None, registry)
    for prompt in ([5, 6, 7], [9, 3, 40, 41, 7, 7]):
        got = tree.generate(prompt, max_new_tokens=24)
        assert got.stats.exactness == "guaranteed"
        assert got.token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
    # dtype auto is the same for a tree as for a chain (bfloat16 where the CPU computes it natively)
    from dynaspec.runtime.numerics import native_bf16, stack_dtype

    auto_tree = stack_from_mapping({**stack, "dtype": "auto"})
    assert stack_dtype(auto_tree) == (torch.bfloat16 if native_bf16() else torch.float32)
    # a tree with more rows than the probe covers is not
    with pytest.raises(ConfigError, match="a tree of up to 9 drafted tokens verifies 10 rows.*total_tokens <= 8"):
        make_engine("llama", drafter, registry, draft={**tree_draft, "total_tokens": 9}, exact="required")
    # a product the probe found variant (as no fallback could fix): a chain is refused too
    tgt = tiny_target("llama", seed=8)
    tgt.make_batch_invariant()
    tgt.batch_invariance = {**tgt.batch_invariance, "lean 96x32 float32": "variant"}
    chain = {"name": "c", "target": "tiny-llama", "drafter": "in-memory", "draft": {"mode": "chain", "depth": 3}}
    with pytest.raises(ConfigError, match="lean 96x32 float32"):
        Engine(stack_from_mapping(chain), tgt, drafter, registry=registry)
    observed = Engine(stack_from_mapping({**chain, "exact": "observed"}), tgt, drafter, registry=registry)
    assert observed.exactness == "not guaranteed" and "lean 96x32 float32" in observed.exactness_reason
    with pytest.raises(ConfigError, match="exact.*must be one of required, observed"):
        stack_from_mapping({**chain, "exact": "maybe"})


def test_chains_longer_than_the_probe_covers_are_not_guaranteed():
    """Every row count a verification can hold is probed: a chain of depth d verifies d + 1 rows,
    and a depth beyond the probed counts is refused under "required", reported under "observed"."""
    from dynaspec.runtime import numerics

    registry, drafter = builtin_registry(), trained_drafter("llama")
    deepest = make_engine("llama", drafter, registry, draft={"mode": "chain", "depth": 8})
    probed = deepest.target.probed_rows
    assert probed == numerics._contiguous(numerics.HEAD_PROBE_ROWS) == 9  # 1 to 9 rows: depth 8
    assert all(n in bi.PROBE_ROWS for n in range(2, 17))
    assert deepest.exactness == "guaranteed", deepest.exactness_reason
    with pytest.raises(ConfigError, match="verifies 10 rows, and the probe covers 1 to 9"):
        make_engine("llama", drafter, registry, draft={"mode": "chain", "depth": 9}, exact="required")
    deeper = make_engine("llama", drafter, registry, draft={"mode": "chain", "depth": 9}, exact="observed")
    assert deeper.exactness == "not guaranteed" and "draft.depth <= 8" in deeper.exactness_reason


def test_the_verdict_names_only_the_products_in_use():
    """A lean target computes through its fused products: a Hugging Face module's product the
    probe found variant neither breaks the guarantee nor shows in its reason."""
    tgt = tiny_target("llama", seed=9)
    tgt.make_batch_invariant()
    assert tgt.forward_kind == "lean"
    tgt.batch_invariance = {**tgt.batch_invariance, "96x32 float32": "variant"}
    chain = {"name": "c", "target": "tiny-llama", "drafter": "in-memory", "draft": {"mode": "chain", "depth": 3}}
    engine = Engine(stack_from_mapping(chain), tgt, trained_drafter("llama"), registry=builtin_registry())
    assert engine.exactness == "guaranteed"
    kinds = engine.exactness_reason.split("(")[1].split(")")[0].split(", ")  # "... machine (stock, pad 16); ..."
    assert kinds and "variant" not in kinds


def test_eval_reports_exactness_per_stack():
    from dynaspec.evaluation.evaluate import exactness_of

    assert exactness_of([{"exactness": "guaranteed", "exact": True}]) == "guaranteed"
    assert exactness_of([{"exactness": "not guaranteed", "exact": True}]) == "observed"
    assert exactness_of([{"exactness": "not guaranteed", "exact": True},
                         {"exactness": "not guaranteed", "exact": False}]) == "not guaranteed"


def test_observed_stacks_skip_padding_and_say_so():
    """Where the probe padded a product, a "required" stack keeps the padded (strict) kernels and
    its guarantee; an "observed" stack on the same target runs the stock ones and is not
    guaranteed; its output is still compared with its own (relaxed) plain decoding."""
    registry = builtin_registry()
    tgt = tiny_target("llama", seed=9)
    tgt.make_batch_invariant()
    padded = {k: ("pad 4" if k.startswith("lean ") else v) for k, v in tgt.batch_invariance.items()}
    tgt.batch_invariance = padded
    chain = {"name": "c", "target": "tiny-llama", "drafter": "in-memory", "draft": {"mode": "chain", "depth": 3}}
    required = Engine(stack_from_mapping(chain), tgt, trained_drafter("llama"), registry=registry)
    observed = Engine(stack_from_mapping({**chain, "exact": "observed"}), tgt, trained_drafter("llama"),
                      registry=registry)
    assert (required.strict, required.exactness) == (True, "guaranteed")
    assert (observed.strict, observed.exactness) == (False, "not guaranteed")
    assert "lean " in observed.exactness_reason
    assert tgt.variant_products(strict=False) and not tgt.variant_products()


def test_greedy_token_is_the_padded_heads_argmax_and_certifies_most_steps(monkeypatch):
    """Where the strict head pads, the greedy token comes from the one-row product when its top-2
    margin is beyond the float32 error bound, and from the padded product otherwise; either way
    it is the padded product's argmax."""
    from dynaspec.runtime import batch_invariance as bi_mod
    from dynaspec.runtime.numerics import certificate as _certificate

    tgt = tiny_target("llama", seed=11)
    tgt.make_batch_invariant()
    # the head as if the probe had padded it (whatever this machine's kernels do)
    tgt._head = bi_mod._padded_linear(tgt.lm_head_weight, None, 4)
    tgt._certify = _certificate(tgt, "pad 4")
    assert tgt._certify is not None and tgt._certify > 0
    padded_calls = []
    real = tgt._head
    tgt._head = lambda h: padded_calls.append(1) or real(h)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        h = torch.randn(1, tgt.hidden_size, generator=gen)
        assert tgt.greedy_token(h) == int(real(h)[0].argmax())
    assert len(padded_calls) < 10  # most margins are far beyond the bound
    # a tie: two head rows made equal, so the margin is 0 and the padded product decides
    w = tgt.lm_head_weight
    with torch.no_grad():
        h = torch.randn(1, tgt.hidden_size, generator=gen)
        top = int(F.linear(h, w)[0].argmax())
        other = 5 if top != 5 else 6
        saved = w[other].clone()
        w[other] = w[top]
        padded_calls.clear()
        assert tgt.greedy_token(h) == min(other, top) == int(real(h)[0].argmax())
        assert padded_calls == [1]
        w[other] = saved
    assert _certificate(tgt, "stock") is None


@pytest.mark.parametrize(("flags", "capability", "isa", "native"), [
    ({"avx512f", "avx512_bf16"}, "AVX512", None, True),
    ({"avx512f", "amx_bf16"}, "AVX512", "avx512_core_amx", True),
    ({"avx512f", "avx512_bf16"}, "AVX2", None, False),  # ATEN_CPU_CAPABILITY=avx2
    ({"avx512f", "avx512_bf16"}, "AVX512", "AVX2", False),  # ONEDNN_MAX_CPU_ISA=AVX2
    ({"avx512f", "avx512_bf16"}, "AVX512", "AVX512_CORE", False),  # AVX-512 without its bf16 dot products
    ({"avx2", "fma"}, "AVX2", None, False),
])
def test_auto_dtype_follows_the_kernels_that_will_run(monkeypatch, flags, capability, isa, native):
    """``dtype = "auto"`` is bfloat16 only where the kernels in use compute it natively: the
    CPU's flags, torch's dispatch capability and oneDNN's ISA limit, not the flags alone."""
    from dynaspec.runtime import numerics as target_mod

    monkeypatch.setattr(target_mod, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    if isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert target_mod.native_bf16("cpu") is native
    assert target_mod.resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)


def test_auto_drafts_a_tree_where_rows_are_cheap_and_the_chain_elsewhere(monkeypatch):
    """draft.mode = "auto": the engine drafts the stack's tree where its target verifies a tree's
    rows for about the cost of one (numerics.cheap_rows), else the chain of the stack's depth;
    greedy output is the target's either way."""
    from dynaspec.runtime import numerics

    registry, drafter = builtin_registry(), trained_drafter("llama")
    draft = {"mode": "auto", "depth": 3, "topk": 2, "total_tokens": 4}
    assert stack_from_mapping({"name": "s", "target": "tiny-llama", "drafter": "in-memory",
                               "draft": draft}).exact == "required"
    prompt = [5, 17, 42, 8, 99, 3]
    for cheap, want in ((False, ("chain", 1, 3)), (True, ("tree", 2, 4))):
        monkeypatch.setattr(numerics, "cheap_rows", lambda target, cheap=cheap: cheap)
        engine = make_engine("llama", drafter, registry, draft=draft)
        d = engine.stack.draft
        assert (d.mode, d.topk, d.total_tokens) == want and d.depth == 3
        assert engine.source.chains_only == (not cheap)
        assert engine.exactness == "guaranteed", engine.exactness_reason
        plain = Engine(stack_from_mapping({"name": "p", "target": "tiny-llama"}), engine.target, None,
                       registry=registry)
        got = engine.generate(prompt, max_new_tokens=12)
        assert got.stats.exactness == "guaranteed"
        assert got.token_ids == plain.generate(prompt, max_new_tokens=12).token_ids


def test_cheap_rows_only_for_the_quantised_kernel_on_amx(monkeypatch):
    from dynaspec.runtime import numerics, q8

    float_target = tiny_target("llama")
    float_target.make_batch_invariant()
    assert not numerics.cheap_rows(float_target)  # float products: rows cost what they cost
    fake = types.SimpleNamespace(forward_kind="lean", weights="w8a8", w8a8_int16=(), device=torch.device("cpu"))
    monkeypatch.setattr(q8, "amx", lambda level=None: False)
    assert not numerics.cheap_rows(fake)
    monkeypatch.setattr(q8, "amx", lambda level=None: True)
    assert numerics.cheap_rows(fake) == (q8.available() is None)
    assert not numerics.cheap_rows(types.SimpleNamespace(**{**vars(fake), "w8a8_int16": ("lm_head",)}))
    assert not numerics.cheap_rows(types.SimpleNamespace(**{**vars(fake), "forward_kind": "generic"}))
