"""Quantised target weights (float16, int8 head): the kernels compute the product, their rows do not
depend on the batch, and speculative output equals plain decoding with the same weights."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from conftest import builtin_registry, random_drafter, trained_drafter
from dynaspec.errors import ConfigError
from dynaspec.runtime import quantized as q
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.engine import Engine

pytestmark = pytest.mark.skipif(not q.fbgemm_available(), reason="FBGEMM's kernels are x86-only")


@pytest.fixture(autouse=True)
def _verdicts(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNASPEC_VERDICTS_FILE", str(tmp_path / "verdicts.json"))


def _weight(n=96, k=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen)


def test_float16_product_is_the_product_of_float16_weights():
    weight, bias = _weight()
    x = torch.randn(5, 64)
    got = q.Float16Linear(weight, bias)(x)
    want = F.linear(x.double(), weight.half().double(), bias.double())
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_int8_product_is_close_and_each_row_is_its_own():
    weight, bias = _weight()
    kernel = q.Int8Linear(weight, bias)
    x = torch.randn(4, 64)
    exact = F.linear(x, weight, bias)
    got = kernel(x)
    assert ((got - exact).norm() / exact.norm()) < 0.03  # 7-bit rows, 8-bit weights
    # a row's result never depends on the rows beside it, even one a million times larger: a plain
    # per-tensor dynamic quantisation would crush the small rows to zero here
    loud = torch.cat([x, 1e6 * torch.randn(1, 64)])
    assert torch.equal(kernel(loud)[:4], got)
    for i in range(4):
        assert torch.equal(kernel(x[i:i + 1]), got[i:i + 1])
    # the quantised weight the kernel reads is within half a step of the weight
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((kernel.quantised_weight() - weight).abs() <= step / 2 + 1e-7).all()


def test_probe_finds_the_good_row_counts():
    weight, _ = _weight()

    def rowwise(x):  # one row at a time: invariant by construction
        return torch.cat([F.linear(x[i:i + 1], weight) for i in range(x.shape[0])])

    def odd(x):  # a kernel that rounds differently for 1, 2 and 7 rows
        y = rowwise(x)
        return y + 1e-3 if x.shape[0] in (1, 2, 7) else y

    assert q.probe_quantized(odd, 64, weight, rows=9) == "pad-to 3,4,5,6,8,9"
    fixed = q.padded(odd, (3, 4, 5, 6, 8, 9))
    x = torch.randn(9, 64)
    for rows in range(1, 10):
        assert torch.equal(fixed(x[:rows]), rowwise(x[:rows]))
    assert q.probe_quantized(rowwise, 64, weight, rows=6) == "stock"
    assert q.probe_quantized(lambda x: rowwise(x) * (1 + 1e-3 * x.shape[0]), 64, weight, rows=6) == "variant"
    assert q.probe_quantized(q.Int8Linear(weight), 64, weight) == "stock"


def test_quantized_linear_remembers_and_names_its_kind():
    weight, bias = _weight(n=48, k=32)
    verdict, strict, relaxed = q.quantized_linear("int8-dynamic", weight, bias)
    assert verdict == "stock (int8-dynamic)" and strict is relaxed
    verdict16, strict16, _ = q.quantized_linear("float16", weight, bias)
    assert verdict16.endswith("(float16)")
    x = torch.randn(16, 32)
    whole = strict16(x)
    for rows in range(1, 17):  # strict: every row as in any other row count
        assert torch.equal(strict16(x[:rows]), whole[:rows])


def test_weights_settings_are_checked():
    assert q.resolve_weights("auto") == "dtype"  # a target nobody measured keeps its own weights
    assert q.resolve_weights("auto", measured="int8-head") == "int8-head"
    assert q.resolve_weights("dtype") == "dtype"
    with pytest.raises(ConfigError, match="weights 'int4'"):
        q.resolve_weights("int4")
    with pytest.raises(ConfigError, match="weights"):
        stack_from_mapping({"name": "s", "target": "tiny-llama", "weights": "int4"})
    assert stack_from_mapping({"name": "s", "target": "tiny-llama", "weights": "float16"}).to_dict()[
        "weights"] == "float16"


def _target(kind, weights):
    from dynaspec.plugins.tiny import tiny_target

    return tiny_target(kind).use_weights(weights)


def _int8_runs():
    from dynaspec.runtime.q8 import available

    return available() is None


def _w8a8_runs():
    return q.weights_problem("w8a8") is None


WEIGHTS = ["float16", "int8-head",
           pytest.param("int8", marks=pytest.mark.skipif(not _int8_runs(), reason="the int8 kernel does not build")),
           pytest.param("w8a8", marks=pytest.mark.skipif(not _w8a8_runs(), reason="no AVX-512 VNNI here"))]
KERNELS = {"float16": ("float16", "float16"), "int8-head": ("float16", "int8-dynamic"), "int8": ("int8", "int8"),
           "w8a8": ("w8a8", "w8a8")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_speculative_equals_plain_decoding_with_the_same_weights(kind, weights, dtype):
    from dynaspec.plugins.tiny import tiny_target

    registry = builtin_registry()
    target = tiny_target(kind).to(dtype=dtype).use_weights(weights)
    common = {"name": "t", "target": f"tiny-{kind}", "weights": weights, "dtype": dtype}
    plain = Engine(stack_from_mapping({**common, "drafter": None}), target, registry=registry)
    report = target.batch_invariance
    body, head = KERNELS[weights]
    assert all(v.endswith(f"({body})") for k, v in report.items() if k.startswith("lean "))
    assert report[next(k for k in report if k.startswith("lm_head"))].endswith(f"({head})")
    if weights in ("int8", "w8a8"):
        assert all(v.startswith("stock") for k, v in report.items() if k.startswith(("lean ", "lm_head")))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 99, (int(torch.randint(2, 10, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(3)]
    for drafter, depth in ((trained_drafter(kind), 3), (trained_drafter(kind), 6), (random_drafter(kind), 4)):
        spec = Engine(stack_from_mapping({**common, "drafter": "in-memory", "draft": {"mode": "chain", "depth": depth}}),
                      target, drafter, registry=registry)
        assert spec.exactness == "guaranteed", spec.exactness_reason
        for prompt in prompts:
            want = plain.generate(prompt, max_new_tokens=32).token_ids
            got = spec.generate(prompt, max_new_tokens=32)
            assert got.token_ids == want, (kind, weights, depth, prompt)
            assert got.stats.new_tokens == 32


@pytest.mark.skipif(not _w8a8_runs(), reason="no AVX-512 VNNI here")
def test_w8a8_keeps_the_products_a_target_names_at_16_bit_activations(tmp_path):
    """A target's ``w8a8_int16`` products run on the int16 mode (exactly as under int8 weights),
    the others on 8-bit activations; the guarantee and an image of it hold as ever."""
    from dynaspec.plugins.tiny import tiny_target
    from dynaspec.runtime.image import load_image, save_image

    registry = builtin_registry()
    target = tiny_target("gemma3").to(dtype="bfloat16")
    target.w8a8_int16 = frozenset({"down", "lm_head"})
    common = {"name": "t", "target": "tiny-gemma3", "weights": "w8a8", "dtype": "bfloat16"}
    plain = Engine(stack_from_mapping({**common, "drafter": None}), target, registry=registry)
    report = target.batch_invariance
    down = "lean 32x64 bfloat16"  # the only product of 64 inputs (the MLP's width)
    assert report[down] == "stock (int8)"
    assert report[next(k for k in report if k.startswith("lm_head"))] == "stock (int8)"
    others = [v for k, v in report.items() if k.startswith("lean ") and k != down]
    assert others and all(v == "stock (w8a8)" for v in others)
    # the kept products compute what int8 weights compute; the rest differ from them
    int8 = tiny_target("gemma3").to(dtype="bfloat16").use_weights("int8")
    Engine(stack_from_mapping({**common, "weights": "int8", "drafter": None}), int8, registry=registry)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(target._lean_decoder().layers[0].down[0](x), int8._lean_decoder().layers[0].down[0](x))
    h = torch.randn(3, 32).to(torch.bfloat16)
    assert torch.equal(target.logits(h), int8.logits(h))
    assert not torch.equal(target._lean_decoder().layers[0].qkv[0](h), int8._lean_decoder().layers[0].qkv[0](h))
    spec = Engine(stack_from_mapping({**common, "drafter": "in-memory", "draft": {"mode": "chain", "depth": 4}}),
                  target, trained_drafter("gemma3"), registry=registry)
    assert spec.exactness == "guaranteed"
    for prompt in ([5, 9, 14], [40, 41, 42, 43]):
        assert spec.generate(prompt, max_new_tokens=24).token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
    assert save_image(target, tmp_path / "image", source_id="test")
    mapped = load_image(tmp_path / "image")
    assert mapped.w8a8_int16 == target.w8a8_int16
    Engine(stack_from_mapping({**common, "drafter": None}), mapped, registry=registry)
    assert mapped.batch_invariance == target.products_in_use()
    assert torch.equal(mapped.logits(h), target.logits(h))


def test_a_target_serves_only_its_own_weights():
    registry = builtin_registry()
    target = _target("llama", "float16")
    Engine(stack_from_mapping({"name": "a", "target": "tiny-llama", "weights": "float16"}), target,
           registry=registry)
    with pytest.raises(ConfigError, match="one target per weights setting"):
        Engine(stack_from_mapping({"name": "b", "target": "tiny-llama", "weights": "dtype"}), target,
               registry=registry)
    with pytest.raises(ConfigError, match="before make_batch_invariant"):
        target.use_weights("int8-head")


def test_packing_in_row_blocks_computes_the_same_product(monkeypatch):
    weight, bias = _weight(n=100, k=64)
    x = torch.randn(3, 64)
    whole8, whole16 = q.Int8Linear(weight, bias)(x), q.Float16Linear(weight, bias)(x)
    monkeypatch.setattr(q, "PACK_ROWS", 32)
    blocked8, blocked16 = q.Int8Linear(weight, bias), q.Float16Linear(weight, bias)
    assert len(blocked8.packed) == len(blocked16.packed) == 4  # 32 + 32 + 32 + 4 rows
    assert torch.equal(blocked8(x), whole8)  # integer sums: exact whatever the blocking
    assert torch.allclose(blocked16(x), whole16, rtol=1e-5, atol=1e-5)
    assert blocked8.quantised_weight().shape == weight.shape


def test_weight_bytes_follow_the_weights_setting():
    from dynaspec.evaluation.cost_model import weight_bytes
    from dynaspec.plugins.tiny import tiny_target

    target = tiny_target("llama")
    total = sum(p.numel() for p in target.model.parameters())
    head = target.lm_head_weight.numel()
    assert weight_bytes(target) == total * 4  # float32, as loaded
    for weights, want in (("float16", 2 * total), ("int8-head", 2 * (total - head) + head), ("int8", total),
                         ("w8a8", total)):
        target.weights = weights  # the setting alone decides the count
        assert weight_bytes(target) == want, weights


@pytest.mark.skipif(not _int8_runs(), reason="the int8 kernel does not build")
def test_the_drafter_computes_on_the_targets_kernel():
    from dynaspec.runtime.q8 import Int8WeightLinear

    drafter = trained_drafter("llama")
    shared = {}
    quick = q.drafter_on_kernel(drafter, "int8", shared)
    assert quick is not drafter and q.drafter_on_kernel(drafter, "int8", shared) is quick  # made once
    assert q.drafter_on_kernel(drafter, "dtype", shared) is drafter  # float weights: as it is
    kernels = [m.forward for m in quick.modules() if isinstance(m, torch.nn.Linear)]
    assert kernels and all(isinstance(k, Int8WeightLinear) for k in kernels)
    assert not any("forward" in vars(m) for m in drafter.modules())  # the original is untouched
    d = drafter.cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    emb, feats = torch.randn(1, 5, d, generator=gen), torch.randn(1, 5, d, generator=gen)
    positions = torch.arange(5)[None]
    with torch.inference_mode():
        want, got = drafter(emb, feats, positions), quick(emb, feats, positions)
    # int8 weights (int16 activations): within a few percent of the float drafter's output
    assert got.shape == want.shape and not torch.equal(got, want)
    assert float((got - want).norm() / want.norm()) < 0.05
    # q, k and v (and gate and up) in one product each: the same outputs as apart, in a pass
    # over a prompt (k and v stacked, the last query apart), a tree step and a chain step
    from dynaspec.runtime.drafter import DraftCache

    layer = quick.layer
    assert set(layer.fused) == {"qkv", "kv", "gate_up"}
    outs = []
    with torch.inference_mode():
        for fused in (layer.fused, None):
            layer.fused, cache = fused, DraftCache(16)
            first = quick(emb, feats, positions, cache=cache, last=True)
            tree = quick(emb[:, :3], feats[:, :3], torch.full((1, 3), 5), cache=cache,
                         mask=torch.ones(3, 8, dtype=torch.bool))
            cache.crop(5)
            chain = quick(emb[:, :1], feats[:, :1], torch.full((1, 1), 5), cache=cache)
            outs.append((first, tree, chain))
        layer.fused = outs and q.fused_products(layer, "int8")
    for stacked, apart in zip(*outs):
        assert torch.equal(stacked, apart)


@pytest.mark.skipif(not _int8_runs(), reason="the int8 kernel does not build")
def test_the_drafter_on_the_kernel_attends_by_the_compiled_attention():
    """Where the compiled attention runs vectorised, the drafter's copy on the kernel attends with
    it: a prompt's pass (the last query alone), a causal pass, a tree step whose rows see their own
    lines (given as a mask) and a chain step all equal torch's attention within rounding, and a
    wrong line would not (the check can fail)."""
    from dynaspec.runtime import q8
    from dynaspec.runtime.drafter import DraftCache, Drafter, DrafterConfig

    cfg = DrafterConfig(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                        vocab_size=64)
    torch.manual_seed(0)
    model = Drafter(cfg).eval()
    quick = q.drafter_on_kernel(model, "int8")
    layer = quick.layer
    if not q8.attention_available(cfg.head_dim):
        assert layer.c_attend is None
        pytest.skip("the compiled attention is not vectorised here")
    assert layer.c_attend is not None
    gen = torch.Generator().manual_seed(1)
    emb, feats = torch.randn(1, 12, 128, generator=gen), torch.randn(1, 12, 128, generator=gen)
    mask = torch.zeros(3, 15, dtype=torch.bool)
    mask[:, :12] = True
    mask[0, 12] = mask[1, 13] = mask[2, 12] = mask[2, 14] = True  # row 2 continues row 0's line
    outs = []
    with torch.inference_mode():
        for attend in (layer.c_attend, None):
            layer.c_attend, cache = attend, DraftCache(32)
            first = quick(emb, feats, torch.arange(12)[None], cache=cache, last=True)
            tree = quick(emb[:, :3], feats[:, :3], torch.tensor([[12, 12, 13]]), cache=cache, mask=mask)
            cache.crop(12)
            chain = quick(emb[:, :1], feats[:, :1], torch.full((1, 1), 12), cache=cache)
            causal = quick(emb, feats, torch.arange(12)[None], cache=DraftCache(32))
            outs.append((first, tree, chain, causal))
        layer.c_attend = outs and functools.partial(q8.attend, lib=q8._library())
        wrong = mask.clone()
        wrong[2, 14] = False
        cache = DraftCache(32)
        quick(emb, feats, torch.arange(12)[None], cache=cache, last=True)
        miss = quick(emb[:, :3], feats[:, :3], torch.tensor([[12, 12, 13]]), cache=cache, mask=wrong)
    for compiled, torch_way in zip(*outs):
        assert compiled.shape == torch_way.shape
        assert float((compiled - torch_way).abs().max()) < 1e-4 * float(torch_way.abs().max()) + 1e-5
    assert float((miss[0, 2] - outs[1][1][0, 2]).abs().max()) > 1e-3


def test_the_router_on_the_kernel_norms_by_the_compiled_norm():
    """The router's copy on the kernel norms both inputs in one C call: the same cluster scores
    as torch's norm within rounding."""
    from dynaspec.shortlisters.router import Router, RouterConfig

    torch.manual_seed(0)
    router = Router(RouterConfig(hidden_size=64, width=32, clusters=16)).eval()
    quick = q.drafter_on_kernel(router, "int8") if _int8_runs() else router
    if quick is router:
        pytest.skip("the int8 kernel does not build")
    assert quick.c_norm is not None and router.c_norm is None
    e, h = torch.randn(3, 64) * 0.02, torch.randn(3, 64) * 5
    with torch.inference_mode():
        compiled = quick(e, h)
        quick.c_norm, norm = None, quick.c_norm
        torch_way = quick(e, h)
        quick.c_norm = norm
    assert float((compiled - torch_way).abs().max()) < 1e-4 * float(torch_way.abs().max())


def test_the_rotary_table_gives_the_angles_computed_directly():
    """The drafter's cos/sin rows come from a table grown by doubling: the same float32 values as
    computing them for the positions asked, whatever the batch, the table's size or its growth."""
    from dynaspec.runtime import drafter as dr

    def direct(positions, dim, theta):
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        ang = positions.float()[:, None, :, None] * inv
        return torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    dr._ROPE_TABLES.clear()
    for positions in (torch.arange(7)[None], torch.full((1, 3), 4095), torch.arange(300, 2600)[None],
                      torch.tensor([[5, 7, 9]])):
        for dim, theta in ((64, 1e6), (32, 10000.0)):
            got, want = dr._rope_angles(positions, dim, theta), direct(positions, dim, theta)
            assert got[0].shape == want[0].shape == (1, 1, positions.shape[1], dim)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert dr._ROPE_TABLES[(64, 1e6, "cpu")][0].shape[0] >= 4096  # grown past its first 1024 rows


def test_an_engine_on_int8_weights_drafts_on_the_int8_kernel():
    if not _int8_runs():
        pytest.skip("the int8 kernel does not build")
    from dynaspec.runtime.q8 import Int8WeightLinear

    registry = builtin_registry()
    target = _target("llama", "int8")
    engine = Engine(stack_from_mapping({"name": "t", "target": "tiny-llama", "weights": "int8", "drafter": "in-memory",
                                        "draft": {"mode": "chain", "depth": 3}}), target, trained_drafter("llama"),
                    registry=registry)
    assert isinstance(engine.drafter.fc.forward, Int8WeightLinear)
    plain = Engine(stack_from_mapping({"name": "p", "target": "tiny-llama", "weights": "int8", "drafter": None}), target,
                   registry=registry)
    prompt = [5, 9, 13, 2]
    assert engine.generate(prompt, max_new_tokens=24).token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
