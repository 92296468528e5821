"""Published EAGLE-3 drafters: synthetic checkpoints in the published layout (``fc`` over three
fused target layers, ``midlayer.*``, their own ``norm``/``lm_head`` over a draft vocabulary mapped by
``d2t``) load, compute what an independent reference computes, draft only inside their vocabulary,
and keep greedy decoding exact and sampling lossless."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_eagle import _layer_sizes, _write
from test_sampling import chi2_pvalue, exact_marginals, sample_counts

from conftest import builtin_registry, make_engine, reference_greedy, target
from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.plugins.tiny import tiny_target
from dynaspec.runtime.config import stack_from_mapping
from dynaspec.runtime.engine import Engine
from dynaspec.runtime.protocols import DecodeParams
from dynaspec.runtime.targets import load_drafter
from dynaspec.runtime.tree import DraftTree

LAYERS = [0, 1, 1]  # the tiny targets have two layers: low, middle and high collapse onto them


def _config(tgt, draft_vocab: int, **extra) -> dict:
    cfg = tgt.model.config
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": cfg.vocab_size,
            "draft_vocab_size": draft_vocab, "eagle_config": {"eagle_aux_hidden_state_layer_ids": LAYERS},
            **extra}


def _weights(tgt, draft_ids: torch.Tensor, *, seed: int = 0, fused: int = 3) -> dict[str, torch.Tensor]:
    h, i, heads, kv, hd, w = _layer_sizes(tgt, seed)

    t2d = torch.zeros(tgt.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return {"fc.weight": w(h, fused * h),
            "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
            "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * h),
            "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * h),
            "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
            "midlayer.mlp.gate_proj.weight": w(i, h), "midlayer.mlp.up_proj.weight": w(i, h),
            "midlayer.mlp.down_proj.weight": w(h, i),
            "midlayer.input_layernorm.weight": 1 + w(h), "midlayer.hidden_norm.weight": 1 + w(h),
            "midlayer.post_attention_layernorm.weight": 1 + w(h),
            "norm.weight": 1 + w(h), "lm_head.weight": w(len(draft_ids), h) * 4,
            "d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d}


def _draft_ids(tgt, n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(tgt.vocab_size, generator=g)[:n].sort().values


def _reference(weights, cfg, emb, hidden, positions):
    """EAGLE-3's draft layer written out from its description, with transformers' rotary helpers:
    h = fc(fused) where 3h wide; attention over [norm(E), norm(h)]; residual h; gated MLP."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    def rms(x, weight, eps=1e-6):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    m = "midlayer."
    h = hidden @ weights["fc.weight"].T if hidden.shape[-1] != cfg["hidden_size"] else hidden
    x = torch.cat([rms(emb, weights[m + "input_layernorm.weight"]), rms(h, weights[m + "hidden_norm.weight"])], -1)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // heads
    t = x.shape[1]
    q = (x @ weights[m + "self_attn.q_proj.weight"].T).view(1, t, heads, hd).transpose(1, 2)
    k = (x @ weights[m + "self_attn.k_proj.weight"].T).view(1, t, kv, hd).transpose(1, 2)
    v = (x @ weights[m + "self_attn.v_proj.weight"].T).view(1, t, kv, hd).transpose(1, 2)
    hf = LlamaConfig(hidden_size=cfg["hidden_size"], num_attention_heads=heads, rope_theta=cfg["rope_theta"])
    cos, sin = LlamaRotaryEmbedding(hf)(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5 + torch.full((t, t), float("-inf")).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, t, heads * hd)
    h = h + attn @ weights[m + "self_attn.o_proj.weight"].T
    y = rms(h, weights[m + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(y @ weights[m + "mlp.gate_proj.weight"].T) * (y @ weights[m + "mlp.up_proj.weight"].T))
    return h + mlp @ weights[m + "mlp.down_proj.weight"].T


def test_fused_features_are_the_inputs_of_the_chosen_layers():
    """``TargetModel.forward(layers=...)`` gives the inputs of those decoder layers side by side:
    what Hugging Face calls ``hidden_states[i]`` for layer i."""
    tgt = tiny_target("llama", num_hidden_layers=6)
    ids = torch.tensor([3, 9, 4, 7, 1])
    hidden, fused = tgt.forward(ids, torch.arange(5), tgt.new_cache(8), layers=(2, 3, 3))
    with torch.no_grad():
        out = tgt.model(ids[None], output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][0] for i in (2, 3, 3)], -1)
    assert fused.shape == (5, 3 * tgt.hidden_size)
    assert torch.allclose(fused, expected, atol=1e-5)
    assert torch.allclose(hidden, tgt.forward(ids, torch.arange(5), tgt.new_cache(8)), atol=1e-6)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle3_drafter_computes_the_reference(tmp_path, fmt):
    tgt = target("llama")
    ids = _draft_ids(tgt, 40)
    cfg, weights = _config(tgt, 40), _weights(tgt, ids)
    drafter = load_drafter(str(_write(tmp_path / "e3", cfg, weights, fmt)), tgt)
    assert drafter.feature_layers == tuple(LAYERS)
    assert torch.equal(drafter.vocabulary, ids)
    assert drafter.head_weight.shape == (40, tgt.hidden_size)
    g = torch.Generator().manual_seed(3)
    t, h = 6, tgt.hidden_size
    emb = torch.randn(1, t, h, generator=g)
    fused = torch.randn(1, t, 3 * h, generator=g)
    positions = torch.arange(t)[None]
    with torch.no_grad():
        mine = drafter(emb, fused, positions)
    reference = _reference(weights, cfg, emb, fused, positions)
    assert torch.allclose(mine, reference, atol=1e-4), (mine - reference).abs().max()
    # deeper steps feed the layer's own (h-wide) output back, with the cache of the earlier ones
    from dynaspec.runtime.drafter import DraftCache

    cache = DraftCache(16)
    with torch.no_grad():
        first = drafter(emb[:, :5], fused[:, :5], positions[:, :5], cache=cache)
        step = drafter(emb[:, 5:], first[:, -1:], positions[:, 5:], cache=cache)
    own = torch.cat([fused[:, :5] @ weights["fc.weight"].T, first[:, -1:]], 1)
    mixed = _reference(weights, cfg, emb, own, positions)
    assert torch.allclose(step, mixed[:, 5:], atol=1e-4)
    # a pass whose last position's output alone is needed (a first draft over the prompt)
    alone = DraftCache(16)
    with torch.no_grad():
        last = drafter(emb[:, :5], fused[:, :5], positions[:, :5], cache=alone, last=True)
    torch.testing.assert_close(last, first[:, -1:])
    assert torch.equal(alone.keys[:, :, :5], cache.keys[:, :, :5])
    # the draft logits are its own head over its normed output
    logits = drafter.head_input(mine) @ drafter.head_weight.T
    expected = (reference * torch.rsqrt(reference.pow(2).mean(-1, keepdim=True) + 1e-6)
                * weights["norm.weight"]) @ weights["lm_head.weight"].T
    assert torch.allclose(logits, expected, atol=1e-3)


@pytest.mark.parametrize("fields", [
    {"draft": {"mode": "chain", "depth": 4}},
    {"draft": {"mode": "tree", "depth": 3, "topk": 3, "total_tokens": 10}},
    # a frequency shortlist inside the draft vocabulary
    {"draft": {"mode": "chain", "depth": 4},
     "shortlister": {"name": "frequency"}, "scheduler": {"name": "fixed", "budget": 60}},
], ids=["chain", "tree", "frequency-inside"])
def test_greedy_is_exact_and_drafts_stay_in_the_draft_vocabulary(tmp_path, monkeypatch, fields):
    tgt = target("llama")
    ids = _draft_ids(tgt, 48)
    folder = _write(tmp_path / "e3", _config(tgt, 48), _weights(tgt, ids))
    if "shortlister" in fields:
        from dynaspec.shortlisters.frequency import save_frequency

        counts = torch.randperm(tgt.vocab_size, generator=torch.Generator().manual_seed(4))
        path = save_frequency(tmp_path / "freq", counts, {"target": tgt.fingerprint()})
        fields = {**fields, "shortlister": {"name": "frequency", "path": str(path)}}
    drafted: list[int] = []
    add = DraftTree.add

    def recording_add(self, parent, token, logq):
        drafted.append(token)
        return add(self, parent, token, logq)

    monkeypatch.setattr(DraftTree, "add", recording_add)
    engine = make_engine("llama", load_drafter(str(folder), tgt), builtin_registry(), **fields)
    for prompt in ([5, 6, 7, 8], [30, 31, 9]):
        assert engine.generate(prompt, max_new_tokens=20).token_ids == reference_greedy("llama", prompt, 20)
    assert drafted and set(drafted) <= set(ids.tolist())
    if "shortlister" in fields:  # inside the shortlist and the draft vocabulary, both
        assert set(drafted) <= set(engine.shortlister.ranking[:60].tolist()) & set(ids.tolist())


def test_sampling_with_an_eagle3_drafter_keeps_the_target_distribution(tmp_path):
    """The drafter can propose only 8 of the 12 tokens: the others must come from the residual."""
    from test_sampling import VOCAB

    tgt = tiny_target("llama", vocab_size=VOCAB, seed=2)
    ids = torch.tensor([0, 1, 3, 4, 6, 7, 9, 11])
    drafter = load_drafter(str(_write(tmp_path / "e3", _config(tgt, 8), _weights(tgt, ids, seed=5))), tgt)
    stack = stack_from_mapping({"name": "s", "target": "tiny", "drafter": "d", "verifier": "sampling",
                                "draft": {"mode": "tree", "depth": 3, "topk": 3, "total_tokens": 9}})
    engine = Engine(stack, tgt, drafter, registry=builtin_registry())
    params = DecodeParams(1.0, 1.0)
    p2, p3 = exact_marginals(tgt, params)
    c2, c3 = sample_counts(engine, params)
    assert chi2_pvalue(c2, p2) > 1e-3 and chi2_pvalue(c3, p3) > 1e-3
    assert 0.5 * np.abs(c2 / c2.sum() - p2).sum() < 0.06


def test_default_feature_layers_and_bad_eagle3_checkpoints(tmp_path):
    deep = tiny_target("llama", num_hidden_layers=8)
    ids = _draft_ids(deep, 32)
    cfg = {k: v for k, v in _config(deep, 32).items() if k != "eagle_config"}
    assert load_drafter(str(_write(tmp_path / "deep", cfg, _weights(deep, ids))), deep).feature_layers == (2, 4, 5)
    tgt = target("llama")  # two layers: the default low/middle/high layers do not exist
    with pytest.raises(ArtifactMismatchError, match=r"reads target layers \[2, 1, -1\], but the target has 2"):
        load_drafter(str(_write(tmp_path / "shallow", cfg, _weights(tgt, ids))), tgt)
    good = _weights(tgt, ids)
    cases = {
        "d2t-range": ({**good, "d2t": good["d2t"] + 1000}, ArtifactMismatchError, "distinct ids"),
        "d2t-shape": ({**good, "d2t": good["d2t"][:5]}, ConfigError, "d2t has shape"),
        "fc-width": ({**good, "fc.weight": good["fc.weight"][:, :64]}, ArtifactMismatchError, "fc.weight is"),
        "no-head": ({k: v for k, v in good.items() if k != "lm_head.weight"}, ConfigError, "lm_head"),
        "unknown": ({**good, "midlayer.extra.weight": torch.zeros(2)}, ConfigError, "unexpected weights"),
    }
    for name, (weights, error, message) in cases.items():
        with pytest.raises(error, match=message):
            load_drafter(str(_write(tmp_path / name, _config(tgt, 32), weights)), tgt)


def test_prepare_trains_a_router_for_an_eagle3_drafter(tmp_path, monkeypatch):
    """DynaSpec shortlists inside the draft vocabulary: ``prepare --drafter EAGLE3`` trains the router
    on the drafter's own features (fc of the fused target layers at depth 0, recomputed from the
    shards' tokens; its outputs deeper), and the stack it writes is exact and drafts inside both the
    routed clusters and the draft vocabulary."""
    from dynaspec.runtime.engine import Engine
    from dynaspec.training.prepare import PrepareBudget, prepare
    from dynaspec.training.router import router_examples
    from dynaspec.training.shards import load_shard, shard_paths

    tgt = target("llama")
    ids = _draft_ids(tgt, 96)
    folder = _write(tmp_path / "e3", _config(tgt, 96), _weights(tgt, ids))
    budget = PrepareBudget(prompts=16, source="generated", shard_size=4, new_tokens=32, router_width=32)
    manifest = prepare("tiny-llama", tmp_path / "out", drafter=str(folder), budget=budget, command="t")
    assert manifest["stages"]["drafter"]["given"] and manifest["stages"]["router"]["held_out_recall"]
    drafted: list[int] = []
    add = DraftTree.add
    monkeypatch.setattr(DraftTree, "add", lambda self, parent, token, logq: (drafted.append(token),
                                                                            add(self, parent, token, logq))[1])
    written = Engine.from_stack(str(tmp_path / "out" / "stack.toml"))
    # the prepared stack drafts with prompt lookup first, then this drafter; the drafter alone here
    assert written.stack.drafter.name == "composite" and written.drafter is not None
    spec = Engine.from_stack(str(tmp_path / "out" / "stack.toml"), overrides={"drafter": str(folder)},
                             target=written.target)
    assert spec.stack.shortlister.name == "dynaspec"
    for prompt in ([5, 6, 7, 8], [30, 31, 9]):
        result = spec.generate(prompt, max_new_tokens=20)
        assert result.token_ids == reference_greedy("llama", prompt, 20)
        assert result.stats.mean_shortlist_size < len(ids)  # the router's clusters, inside the vocabulary
    assert drafted and set(drafted) <= set(ids.tolist())
    # the router's depth-0 examples are fc of the fused features of the position before
    drafter = spec.drafter.float()
    shard = load_shard(shard_paths(tmp_path / "out" / "work")[0])

    def fused(seq):
        return tgt.forward(seq, torch.arange(len(seq)), tgt.new_cache(len(seq) + 1), layers=drafter.feature_layers)[1]

    assignment = torch.zeros(tgt.vocab_size, dtype=torch.long)
    _, prev, _ = router_examples(shard, tgt.embed, assignment, drafter, fused=fused)
    seq = shard["tokens"][: int(shard["offsets"][1])].long()
    first = max(int(shard["prompt_lens"][0]) - 1, 2)
    with torch.no_grad():
        expected = drafter.project(fused(seq)[first - 1].float())
    assert torch.allclose(prev[0], expected, atol=1e-4)
