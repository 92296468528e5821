"""The weight-only int8 kernel (dynaspec.runtime.q8): it computes the product of the dequantised
weights, and a row's result never depends on how many rows, or threads, compute it."""

from __future__ import annotations

import pytest
import torch

from conftest import pack_tiles, quantize_rows
from dynaspec.errors import ConfigError
from dynaspec.runtime import q8
from dynaspec.runtime import quantized as qz

pytestmark = pytest.mark.skipif(q8.available() is not None, reason=f"int8 kernel unavailable: {q8.available()}")

# (out, in): a tile remainder (N % 4) and a column tail (K % 32, K % 16, K % 8) in most of them; the
# last one wide enough that 8-bit activations take it in column chunks (kernels/q8_linear.c)
SHAPES = [(7, 40), (33, 650), (64, 896), (5, 1), (9, 2500)]
DTYPES = [torch.float32, torch.bfloat16]
#: every code path the processor here can run: its best, AVX2 (+FMA) and plain C, each in its modes
LEVELS = [level for level in q8.LEVELS if q8.available(level=level) is None]
PATHS = [(level, mode) for level in LEVELS for mode in q8.modes(level)]


def _case(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (n, 1), generator=gen).float())
    bias = torch.randn(n, generator=gen)
    x = torch.randn(13, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (13, k), generator=gen).float())
    return weight, bias, x


@pytest.mark.parametrize(("level", "mode"), PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernels_packing_is_quantize_rows_then_pack(shape, dtype, level, mode):
    weight, bias, _ = _case(*shape, seed=4)
    weight = weight.to(dtype)
    weight[min(2, shape[0] - 1)] = 0  # a row of zeros
    kernel = q8.Int8WeightLinear(weight, bias, level=level, mode=mode)
    q, scale = quantize_rows(weight)
    assert torch.equal(kernel.scale, scale)
    assert torch.equal(kernel.quantised_weight(), q.float() * scale[:, None])
    lanes, tile_rows = kernel._layout
    padded = torch.cat([q, q.new_zeros(q.shape[0], kernel._padded_in - shape[1])], dim=1)
    packed, tail = pack_tiles(padded, lanes, tile_rows)
    assert torch.equal(kernel._tiled(), packed) and torch.equal(kernel.tail, tail)
    if mode == "int8" and kernel.amx:  # AMX tiles: blocks of 64 outputs, 64 columns a step, 4 tiles of [16][16][4]
        blocks, steps = -(-shape[0] // 64), kernel._padded_in // 64
        rows = torch.cat([padded, padded.new_zeros(blocks * 64 - shape[0], kernel._padded_in)])
        want = rows.view(blocks, 4, 16, steps, 16, 4).permute(0, 3, 1, 4, 2, 5).reshape(-1)
        assert torch.equal(kernel.packed, want) and kernel._chunk == 0
    elif mode == "int8":  # 8-bit activations read wide weights in column chunks: each chunk every tile's columns
        chunk = kernel._chunk
        tiles = packed.view(-1, kernel._padded_in // lanes, tile_rows, lanes)
        want = torch.cat([tiles[:, at:at + chunk // lanes].reshape(-1)
                          for at in range(0, kernel._padded_in // lanes, chunk // lanes)])
        assert torch.equal(kernel.packed, want)
        assert (kernel._padded_in > chunk) == (not torch.equal(kernel.packed, packed))


def test_quantize_rows_round_trip_and_zero_rows():
    weight = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-3.0, 3.0, 1.0]])
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert scale[1] == 1.0 and torch.equal(q[1], torch.zeros(3, dtype=torch.int8))
    assert torch.allclose(q.float() * scale[:, None], weight, atol=float(scale.max()) / 2)
    # every row reaches +-127 at its largest magnitude
    assert q[0, 0] == 127 and q[2, 0] == -127





@pytest.mark.parametrize(("level", "mode"), PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_product_equals_the_dequantised_weights_product(shape, dtype, level, mode):
    weight, bias, x = _case(*shape)
    kernel = q8.Int8WeightLinear(weight.to(dtype), bias, level=level, mode=mode)
    x = x.to(dtype)
    ref = torch.nn.functional.linear(x.double(), kernel.quantised_weight().double(), bias.double())
    got = kernel(x)
    assert got.dtype == dtype and got.shape == (13, shape[0])
    # float32 sums over K terms, then (bfloat16) one rounding of the output; int16 and int8: each
    # input within half a quantisation step (1/32767 or 1/127 of its row's largest magnitude)
    rel = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    wabs = kernel.quantised_weight().double().abs()
    bound = rel * (ref.abs() + x.double().abs() @ wabs.T)
    half_step = {"int16": 0.5 / 32767, "int8": 0.5 / 127}.get(mode)
    if half_step:  # the quantisation step of each input row, times the weights' magnitudes
        bound = bound + 1.0001 * half_step * x.double().abs().amax(dim=1, keepdim=True) * wabs.sum(dim=1)[None, :]
    assert ((got.double() - ref).abs() <= bound + 1e-30).all()
    # and the dequantised weights are within half a step of the weights
    step = kernel.scale[:, None] / 2
    assert ((kernel.quantised_weight() - weight.to(dtype).float()).abs() <= step * 1.0001).all()


@pytest.mark.parametrize(("level", "mode"), PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_do_not_depend_on_the_row_count(shape, dtype, level, mode):
    weight, bias, x = _case(*shape, seed=1)
    kernel = q8.Int8WeightLinear(weight, bias, level=level, mode=mode)
    x = x.to(dtype)
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(len(x))])
    for rows in range(1, len(x) + 1):
        assert torch.equal(kernel(x[:rows]), alone[:rows]), rows
    # nor on the neighbours: the same row after other rows
    assert torch.equal(kernel(torch.cat([x[5:], x[:5]]))[-5:], alone[:5])
    # and the probe of the quantised kernels agrees
    assert qz.probe_quantized(kernel, shape[1], weight.to(dtype)) == "stock"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_activations_compute_exactly_what_the_docstring_says(shape, dtype):
    # row by row in torch: int8 activations (scale = largest magnitude / 127, rounded to even),
    # the exact integer sum rounded to float32, then scaled and the bias added in float32
    if "int8" not in q8.modes():
        pytest.skip("8-bit activations need AVX-512 VNNI")
    weight, bias, x = _case(*shape, seed=3)
    x = x.to(dtype)
    x[1] = 0  # a row of zeros
    kernel = q8.Int8WeightLinear(weight, bias, mode="int8")
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    # a tensor divided by a tensor: torch computes `127.0 / amax` as a reciprocal times 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).clamp(-127, 127).double()
    q = (kernel.quantised_weight() / kernel.scale[:, None]).round().double()
    dot = xq @ q.T  # exact: integers far below 2^53
    want = dot.float() * (amax / 127.0) * kernel.scale[None, :] + bias
    assert torch.equal(kernel(x), want.to(dtype))


@pytest.mark.skipif("int8" not in q8.modes(), reason="8-bit activations need AVX-512 VNNI")
def test_int8_sums_never_overflow():
    # every product at its largest (255 * 127 after the activations' offset) and of one sign: the
    # int32 sum of an accumulator's 16 lanes would overflow after 1,036 steps without the int64 flushes
    k = 64 * 1100
    kernel = q8.Int8WeightLinear(torch.ones(5, k), torch.zeros(5), mode="int8")
    x = torch.ones(2, k)
    assert torch.allclose(kernel(x), torch.full((2, 5), float(k)), rtol=1e-6, atol=0)
    assert torch.allclose(kernel(-x), torch.full((2, 5), -float(k)), rtol=1e-6, atol=0)


def test_each_level_is_the_code_path_it_names():
    expected = {"avx2": ("avx2", ("float", "int16")), "scalar": ("scalar", ("float",))}
    for level in LEVELS:
        if level in expected:
            assert (q8.isa(level), q8.modes(level)) == expected[level]
    # int8 activations are asked for by name: the default keeps activations within float rounding
    assert q8.default_mode() == ("int16" if "int16" in q8.modes() else "float")
    with pytest.raises(ConfigError, match="does not run here"):
        q8.Int8WeightLinear(torch.randn(4, 8), level="scalar", mode="int16")
    with pytest.raises(OSError, match="DYNASPEC_Q8_ISA"):
        q8._library("sse9")


@pytest.mark.parametrize("width", [645, 896])  # the plain C loop, and 16 lanes at a time (AVX-512)
def test_rms_norm_matches_torch_row_by_row(width):
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        x = (torch.randn(3, 5, width, generator=gen) * 4).to(dtype)
        w = torch.randn(width, generator=gen)
        gemma = F.rms_norm(x.float(), (width,), w, 1e-6).to(dtype)
        got = q8.rms_norm(x, w, 1e-6)
        assert got.dtype == dtype and torch.allclose(got.float(), gemma.float(), rtol=1e-5, atol=1e-6)
        wd = w.to(dtype)
        llama = wd * F.rms_norm(x.float(), (width,), None, 1e-6).to(dtype)
        got = q8.rms_norm(x, wd.float(), 1e-6, round_first=True)
        assert torch.allclose(got.float(), llama.float(), rtol=1e-5, atol=1e-6)
        # each row on its own
        flat = x.reshape(-1, width)
        assert torch.equal(torch.cat([q8.rms_norm(flat[i:i + 1], w, 1e-6) for i in range(len(flat))]),
                           q8.rms_norm(flat, w, 1e-6))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        q8.rms_norm(torch.zeros(2, 4, dtype=torch.float16), None, 1e-6)
    with pytest.raises(ValueError, match="contiguous float32 vector of 4"):
        q8.rms_norm(torch.zeros(2, 4), torch.zeros(5), 1e-6)


@pytest.mark.parametrize("width", [645, 896])
def test_add_rms_norm_is_the_addition_then_the_norm_bit_for_bit(width):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(width, generator=gen)
    for dtype in DTYPES:
        h, delta = ((torch.randn(5, width, generator=gen) * 3).to(dtype) for _ in range(2))
        for round_first in (False, True):
            total, normed = q8.add_rms_norm(h, delta, w, 1e-6, round_first=round_first)
            assert torch.equal(total, h + delta)
            assert torch.equal(normed, q8.rms_norm(h + delta, w, 1e-6, round_first=round_first))
    with pytest.raises(ValueError, match="alike"):
        q8.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16), None, 1e-6)
    with pytest.raises(ValueError, match="contiguous float32 vector of 4"):
        q8.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(3), 1e-6)


@pytest.mark.parametrize("width", [37, 4864])  # a 16-lane body and a tail, and lanes alone
def test_silu_mul_is_torchs_gated_activation_row_by_row_on_every_instruction_set(width):
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(5)
    for dtype in DTYPES:
        gate_up = (torch.randn(7, 2 * width, generator=gen) * 6).to(dtype)
        gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])  # the exponential's clamps
        want = (F.silu(gate_up[:, :width].float()) * gate_up[:, width:].float()).to(dtype)
        got = q8.silu_mul(gate_up, width)
        assert got.dtype == dtype and got.shape == (7, width)
        # torch's exponential is another float32 one: within float32 rounding; bfloat16 rounds twice
        tol = dict(rtol=1e-6, atol=1e-30) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-30)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        # each row on its own, and the same bits from the vector lanes, the scalar tail and every level
        assert torch.equal(torch.cat([q8.silu_mul(gate_up[i:i + 1], width) for i in range(7)]), got)
        for level in LEVELS:
            assert torch.equal(q8.silu_mul(gate_up, width, lib=q8._library(level)), got), level
        if width > 16:  # an element computed in the lanes equals the same element in the tail
            shifted = torch.cat([gate_up[:, width - 16:width], gate_up[:, 2 * width - 16:]], dim=1)
            tail = torch.cat([torch.zeros(7, 1, dtype=dtype), shifted[:, :16], torch.zeros(7, 1, dtype=dtype),
                              shifted[:, 16:]], dim=1)
            assert torch.equal(q8.silu_mul(tail, 17)[:, 1:], got[:, width - 16:])
    with pytest.raises(ValueError, match="rows of 8"):
        q8.silu_mul(torch.zeros(2, 6), 4)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        q8.silu_mul(torch.zeros(2, 8, dtype=torch.float16), 4)


@pytest.mark.parametrize("rows", [1, 9, 40])
def test_rope_is_torchs_rotary_embedding_bit_for_bit(rows):
    gen = torch.Generator().manual_seed(6)
    for dtype in DTYPES:
        qkv = torch.randn(rows, 20 * 64, generator=gen).to(dtype)
        x = qkv[:, :18 * 64].view(rows, 18, 64)  # rows at the stride of a wider product, heads contiguous
        table = torch.randn(rows, 2, 64, generator=gen).to(dtype)
        cos, sin = table[:, 0:1], table[:, 1:2]
        want = x * cos + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * sin
        got = q8.rope(x, cos, sin)
        assert got.is_contiguous() and torch.equal(got, want)
        for level in LEVELS:
            assert torch.equal(q8.rope(x, cos, sin, lib=q8._library(level)), want), level
    with pytest.raises(ValueError, match="heads contiguous"):
        q8.rope(torch.zeros(2, 64, 3).transpose(1, 2), torch.zeros(2, 1, 3), torch.zeros(2, 1, 3))
    with pytest.raises(ValueError, match="laid out alike"):
        q8.rope(torch.zeros(2, 3, 8), torch.zeros(2, 1, 8), torch.zeros(1, 1, 8))
    with pytest.raises(ValueError, match="the same for all"):
        q8.rope(torch.zeros(2, 3, 8), torch.zeros(2, 1, 8, dtype=torch.bfloat16), torch.zeros(2, 1, 8))


@pytest.mark.parametrize("mode", q8.modes() if q8.available() is None else ["float"])
def test_rows_do_not_depend_on_the_thread_count(mode):
    weight, bias, x = _case(203, 96, seed=2)
    kernel = q8.Int8WeightLinear(weight, bias, mode=mode)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x)
        torch.set_num_threads(2)
        two = kernel(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bad_inputs_are_refused():
    with pytest.raises(ConfigError, match="2-D weight"):
        q8.Int8WeightLinear(torch.zeros(3))
    kernel = q8.Int8WeightLinear(torch.randn(4, 8))
    with pytest.raises(ValueError, match="9 features for a product with 8 input"):
        kernel(torch.randn(2, 9))
    assert kernel(torch.randn(0, 8)).shape == (0, 4)
    assert kernel(torch.randn(2, 3, 8)).shape == (2, 3, 4)


def test_without_a_compiler_the_kernel_says_why_and_auto_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    compiler = q8._compiler
    monkeypatch.setattr(q8, "_compiler", lambda: None)
    q8._library_for.cache_clear()
    try:
        assert "no C compiler" in q8.available()
        with pytest.raises(ConfigError, match="no C compiler"):
            qz.resolve_weights("int8")
        expected = "int8-head" if qz.fbgemm_available() else "dtype"
        assert qz.resolve_weights("auto", measured="int8") == expected
        assert qz.resolve_weights("auto", measured="w8a8") == expected
        with pytest.raises(ConfigError, match="no C compiler"):
            qz.resolve_weights("w8a8")
    finally:
        monkeypatch.setattr(q8, "_compiler", compiler)
        q8._library_for.cache_clear()
    assert q8.available() is None  # built again (into the temporary cache) once a compiler is back
    assert list((tmp_path / "kernels").glob("q8_linear-*.so"))


def test_w8a8_without_avx512_vnni_falls_back_to_int8(monkeypatch):
    # the AVX2 build has no 8-bit-activation path: auto goes to int8, and asking for w8a8 says why
    if q8.available(level="avx2") is not None:
        pytest.skip("the AVX2 build does not run here")
    monkeypatch.setenv("DYNASPEC_Q8_ISA", "avx2")
    assert "int8" not in q8.modes()
    assert qz.resolve_weights("auto", measured="w8a8") == "int8"
    with pytest.raises(ConfigError, match="AVX-512 VNNI"):
        qz.resolve_weights("w8a8")


def test_a_failed_build_is_reported_with_the_compiler_output(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C;\n")
    monkeypatch.setattr(q8, "SOURCE", bad)
    q8._library_for.cache_clear()
    try:
        problem = q8.available()
        assert problem is not None and "failed" in problem
        assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-written is left
    finally:
        q8._library_for.cache_clear()


@pytest.mark.parametrize("level", [level for level, mode in PATHS if mode == "int16"])
def test_int16_sums_never_overflow(level):
    # every product at its largest (127 * 32767) and of one sign: an int32 lane would overflow after
    # 258 steps of two products without the int64 flushes
    k = 32 * 300
    kernel = q8.Int8WeightLinear(torch.ones(5, k), torch.zeros(5), level=level, mode="int16")
    x = torch.ones(2, k)
    assert torch.equal(kernel(x), torch.full((2, 5), float(k)))
    assert torch.equal(kernel(-x), torch.full((2, 5), -float(k)))


def test_int16_results_are_the_same_on_every_instruction_set():
    # integer sums are exact, and the rest is the same scalar code: AVX-512 VNNI and AVX2 agree bit for bit
    levels = [level for level, mode in PATHS if mode == "int16"]
    if len(levels) < 2:
        pytest.skip("one int16 code path here")
    weight, bias, x = _case(37, 650, seed=5)
    outs = [q8.Int8WeightLinear(weight, bias, level=level, mode="int16")(x) for level in levels]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.skipif(not q8.amx(), reason="no AMX tiles here (Intel Sapphire Rapids and later, Linux)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(130, 4864), (151, 896)])
def test_amx_tiles_give_the_vnni_results_bit_for_bit(shape, dtype, monkeypatch):
    # the same quantised rows and exact int32 sums, the same epilogue: every row count (one tile
    # group is 16 rows) and thread count gives what the AVX-512 VNNI code gives (bfloat16 rows: the
    # tiles' epilogue writes bfloat16 itself, the VNNI code's float32 outputs are converted by torch)
    weight, bias, _ = _case(*shape, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(40, shape[1], generator=gen) * 3).to(dtype)
    monkeypatch.setenv("DYNASPEC_Q8_AMX", "0")
    vnni = q8.Int8WeightLinear(weight, bias, mode="int8")
    monkeypatch.setenv("DYNASPEC_Q8_AMX", "1")
    tiles = q8.Int8WeightLinear(weight, bias, mode="int8")
    assert tiles.amx and not vnni.amx
    assert torch.equal(tiles.quantised_weight(), vnni.quantised_weight()) and torch.equal(tiles.row_sums, vnni.row_sums)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 5, 15, 16, 17, 33, 40):
                assert torch.equal(tiles(x[:m]), vnni(x[:m])), (m, t)
    finally:
        torch.set_num_threads(threads)
    assert qz.probe_quantized(tiles, shape[1], weight) == "stock"


@pytest.mark.skipif(not q8.amx(), reason="no AMX tiles here (Intel Sapphire Rapids and later, Linux)")
@pytest.mark.parametrize("shape", [(130, 896), (64, 650), (7, 40)])
def test_amx_row_groups_in_pairs_or_alone_give_the_same_bits(shape):
    # past 16 rows the tiles take groups of rows in pairs (each weight tile serving both): the same
    # int32 sums and epilogue as one group at a time, float32 and bfloat16 rows, every row count
    weight, bias, _ = _case(*shape, seed=8)
    kernel = q8.Int8WeightLinear(weight, bias, mode="int8")
    assert kernel.amx
    gen = torch.Generator().manual_seed(9)
    for dtype in DTYPES:
        x = (torch.randn(70, shape[1], generator=gen) * 3).to(dtype)
        for m in (1, 16, 17, 31, 32, 33, 48, 63, 70):
            try:
                q8.set_amx_pairs(False)
                alone = kernel(x[:m])
            finally:
                q8.set_amx_pairs(True)
            assert torch.equal(kernel(x[:m]), alone), (m, dtype)


@pytest.mark.skipif(not q8.amx(), reason="no AMX tiles here (Intel Sapphire Rapids and later, Linux)")
def test_amx_packing_is_saved_and_refused_by_a_kernel_without_tiles(monkeypatch):
    weight, bias, x = _case(100, 130, seed=7)
    tiles = q8.Int8WeightLinear(weight, bias, mode="int8")
    tensors, meta = tiles.state()
    assert meta["amx"] is True
    assert torch.equal(q8.Int8WeightLinear.from_state(tensors, meta)(x), tiles(x))
    monkeypatch.setenv("DYNASPEC_Q8_AMX", "0")
    with pytest.raises(ValueError, match="AMX"):
        q8.Int8WeightLinear.from_state(tensors, meta)
    vnni = q8.Int8WeightLinear(weight, bias, mode="int8")
    monkeypatch.setenv("DYNASPEC_Q8_AMX", "1")
    with pytest.raises(ValueError, match="AMX"):
        q8.Int8WeightLinear.from_state(*vnni.state())


@pytest.mark.skipif(not q8.amx(), reason="no AMX tiles here (Intel Sapphire Rapids and later, Linux)")
def test_amx_int32_sums_reach_their_bound_without_overflow():
    # tiles sum in int32: the longest rows they take keep 255 * 127 * K below 2^31; longer rows
    # go to the VNNI code (int64 flushes)
    k = q8._library().q8_amx_max_k() // 64 * 64
    kernel = q8.Int8WeightLinear(torch.ones(3, k), torch.zeros(3), mode="int8")
    assert kernel.amx
    x = torch.ones(2, k)
    assert torch.allclose(kernel(x), torch.full((2, 3), float(k)), rtol=1e-6, atol=0)
    assert torch.allclose(kernel(-x), torch.full((2, 3), -float(k)), rtol=1e-6, atol=0)
    assert not q8.Int8WeightLinear(torch.ones(3, k + 64), mode="int8").amx


@pytest.mark.parametrize("mode", [m for m in q8.modes() if m != "float"] or [pytest.param("int8", marks=pytest.mark.skip(
    reason="no integer activation mode here"))])
def test_scratch_is_one_buffer_per_thread_whatever_the_row_counts(mode):
    # every product quantises its activation rows into its thread's one scratch buffer, grown to
    # the largest call: many prompt lengths keep one buffer (not one per product and row count),
    # and what a larger call left in it (past the rows a smaller call writes, in an AMX tile group)
    # changes no result
    import threading

    wide, narrow = q8.Int8WeightLinear(*_case(33, 650, seed=3)[:2], mode=mode), \
        q8.Int8WeightLinear(*_case(64, 896, seed=4)[:2], mode=mode)
    gen = torch.Generator().manual_seed(8)
    xw, xn = torch.randn(70, 650, generator=gen), torch.randn(70, 896, generator=gen)
    fresh = {}

    def alone():  # a new thread: a new, zeroed buffer
        fresh["w"] = [wide(xw[:m]) for m in (1, 3, 17)]
        fresh["n"] = [narrow(xn[:m]) for m in (1, 3, 17)]

    worker = threading.Thread(target=alone)
    worker.start()
    worker.join()
    for m in range(1, 71):  # every row count, both products, one after another
        wide(xw[:m]), narrow(xn[:m])
    dtype = torch.uint8 if mode == "int8" else torch.int16
    mine = [key for key in q8._SCRATCH if key[0] == threading.get_ident() and key[1] == dtype]
    assert len(mine) == 1  # one buffer for all 140 calls
    rows = -(-70 // 16) * 16 if narrow.amx else 70
    assert q8._SCRATCH[mine[0]][0].numel() >= rows * narrow._padded_in  # at least the largest call's
    for i, m in enumerate((1, 3, 17)):
        assert torch.equal(wide(xw[:m]), fresh["w"][i]) and torch.equal(narrow(xn[:m]), fresh["n"][i])


def test_rounding_to_bfloat16_in_place_is_the_conversions_rounding():
    # ties to even (both ways), the largest finite values, infinities, NaNs, subnormals, signed zeros
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F7FFF, 0xFF7FFFFF,
                         0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0x00000001, 0x00008000,
                         0x80018000, 0x00000000, 0x80000000], dtype=torch.int64).to(torch.int32)
    gen = torch.Generator().manual_seed(9)
    values = torch.cat([bits.view(torch.float32), torch.randn(4096, generator=gen) * 1e3,
                        torch.randint(-2**31, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64)
                        .to(torch.int32).view(torch.float32)])
    mine = values.clone()
    q8._library().q8_round_bf16(mine.data_ptr(), mine.numel())
    theirs = values.to(torch.bfloat16).float()
    nan = torch.isnan(theirs)
    assert torch.equal(torch.isnan(mine), nan)
    assert torch.equal(mine[~nan].view(torch.int32), theirs[~nan].view(torch.int32))  # signed zeros too


@pytest.mark.parametrize("mode", q8.modes())
@pytest.mark.parametrize("dtype", DTYPES)
def test_float_logits_are_the_product_in_float32_bit_for_bit(mode, dtype):
    weight, bias, x = _case(301, 650, seed=10)
    lin = q8.Int8WeightLinear(weight, bias, mode=mode)
    for rows in (x[:1], x[:9], x[:9].reshape(3, 3, 650)):
        rows = rows.to(dtype)
        mine, theirs = lin.float_logits(rows), lin(rows).float()
        assert mine.dtype == torch.float32 and mine.shape == theirs.shape
        assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32))


def test_argmax_is_torchs_first_largest_index():
    gen = torch.Generator().manual_seed(11)
    rows = [torch.randn(n, generator=gen) for n in (1, 15, 16, 17, 151936)]
    tied = torch.zeros(40)
    tied[[7, 23, 31]] = 2.0  # the first of equal largest values
    zeros = torch.tensor([-0.0, 0.0, -1.0])  # signed zeros are equal
    infinite = torch.tensor([1.0, float("inf"), 3.0, float("inf")])
    nan = torch.tensor([1.0, float("nan"), 3.0] * 7)  # torch's answer, whatever it is
    flat = torch.randn(1, 300, generator=gen)  # a [1, V] row: the flat index, as int(t.argmax())
    strided = torch.randn(64, generator=gen)[::2]  # not contiguous: torch's
    for row in [*rows, tied, zeros, infinite, nan, flat, strided, torch.randn(33, generator=gen).bfloat16()]:
        assert q8.argmax(row) == int(row.argmax()), row
    assert q8.argmax(tied) == 7


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 70])
def test_int8_rows_are_what_their_docstring_says_with_either_activations(shape, m):
    """Shortlisted int8 rows, read in place in any order and any count (not a multiple of the
    kernel's four rows), with 8-bit activations on AVX-512 VNNI (exact integer sums, bit for bit;
    past 64 activation rows in groups) and with float32 activations (to float32's rounding); the
    same bits with two threads as with one."""
    from conftest import int8_rows_reference

    n, k = shape
    weight, _, _ = _case(n, k, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (m, k), generator=gen).float())
    x[0] = 0  # a row of zeros
    q, scale = quantize_rows(weight)
    vnni = "int8" in q8.modes()  # 8-bit activations wherever AVX-512 VNNI is
    ids = torch.randint(0, n, (2 * n + 3,), generator=gen)  # repeats, out of order
    assert q8.Int8Rows(weight).int8_activations == vnni  # "auto"
    for u8 in ([True, False] if vnni else [False]):
        rows = q8.Int8Rows(weight, activations="int8" if u8 else "float")
        assert rows.int8_activations == u8
        got = rows.logits(x, ids)
        want = int8_rows_reference(x, q[ids], scale[ids], u8)
        if u8:
            assert torch.equal(got, want)
        else:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(rows.logits(x, ids), got)
        finally:
            torch.set_num_threads(threads)
    if not vnni:
        with pytest.raises(ConfigError, match="AVX-512 VNNI"):
            q8.Int8Rows(weight, activations="int8")
    with pytest.raises(ConfigError, match="must be one of"):
        q8.Int8Rows(weight, activations="int4")


def test_huge_pages_move_the_weights_and_keep_every_result():
    """q8.huge_pages copies the int8 weights of live kernels (products and int8 rows) into one
    arena advised for transparent huge pages, once: the same results bit for bit after the move."""
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no transparent huge pages on this system")
    weight, bias, x = _case(300, 200, seed=4)
    kernel = q8.Int8WeightLinear(weight, bias)
    rows = q8.Int8Rows(weight)
    ids = torch.tensor([5, 0, 299, 17])
    before, before_rows = kernel(x), rows.logits(x, ids)
    old = kernel.packed.data_ptr()
    moved = q8.huge_pages(min_bytes=0)
    assert moved >= kernel.packed.numel() + rows.q.numel()
    assert kernel.packed.data_ptr() != old
    assert torch.equal(kernel(x), before) and torch.equal(rows.logits(x, ids), before_rows)
    assert q8.huge_pages(min_bytes=0) == 0  # nothing left to move
