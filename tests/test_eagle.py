"""Published EAGLE-1/2 drafters (EAGLE-3: tests/test_eagle3.py): synthetic checkpoints in exactly the published layout load, compute
what the reference Llama decoder layer computes, and keep greedy decoding exact."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from conftest import builtin_registry, make_engine, reference_greedy, target
from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.runtime.eagle import load_eagle
from dynaspec.runtime.targets import load_drafter


def _eagle_config(tgt, **extra) -> dict:
    cfg = tgt.model.config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": cfg.vocab_size, "bias": True, **extra}


def _layer_sizes(tgt, seed: int):
    """The tiny target's sizes (hidden, intermediate, heads, kv heads, head dim) and a seeded
    random-weight maker, for synthetic checkpoints."""
    g = torch.Generator().manual_seed(seed)
    h, i = tgt.hidden_size, tgt.model.config.intermediate_size
    heads, kv = tgt.model.config.num_attention_heads, tgt.model.config.num_key_value_heads

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    return h, i, heads, kv, h // heads, w


def _eagle_weights(tgt, *, bias: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    h, i, heads, kv, hd, w = _layer_sizes(tgt, seed)

    weights = {"fc.weight": w(h, 2 * h), "layers.0.self_attn.q_proj.weight": w(heads * hd, h),
               "layers.0.self_attn.k_proj.weight": w(kv * hd, h), "layers.0.self_attn.v_proj.weight": w(kv * hd, h),
               "layers.0.self_attn.o_proj.weight": w(h, heads * hd), "layers.0.mlp.gate_proj.weight": w(i, h),
               "layers.0.mlp.up_proj.weight": w(i, h), "layers.0.mlp.down_proj.weight": w(h, i),
               "layers.0.post_attention_layernorm.weight": 1 + w(h),
               "embed_tokens.weight": w(tgt.vocab_size, h)}  # EAGLE-1 ships a copy; the target's is used
    if bias:
        weights["fc.bias"] = w(h)
    return weights


def _write(folder, config, weights, fmt="safetensors"):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(weights, folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle_drafter_computes_the_reference_layer(tmp_path, fmt):
    """Our drafter on the loaded weights equals fc -> transformers' LlamaDecoderLayer without its
    input norm, on a sequence (causal attention, rotary positions)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    tgt = target("llama")
    config, weights = _eagle_config(tgt), _eagle_weights(tgt)
    drafter = load_eagle(_write(tmp_path / "eagle", config, weights, fmt), tgt.fingerprint())
    assert not drafter.cfg.input_norm and not drafter.cfg.output_norm and drafter.cfg.fc_bias

    hf_cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "bias")})
    hf_cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(hf_cfg, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in weights.items()
                           if k.startswith("layers.0.")}, strict=False)
    g = torch.Generator().manual_seed(3)
    t = 5
    emb, feats = torch.randn(1, t, tgt.hidden_size, generator=g), torch.randn(1, t, tgt.hidden_size, generator=g)
    positions = torch.arange(t)[None]
    x = torch.cat([emb, feats], -1) @ weights["fc.weight"].T + weights["fc.bias"]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    cos_sin = LlamaRotaryEmbedding(hf_cfg)(x, positions)
    out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
    reference = out[0] if isinstance(out, tuple) else out
    with torch.no_grad():
        mine = drafter(emb, feats, positions)
    assert torch.allclose(mine, reference, atol=1e-4), (mine - reference).abs().max()


@pytest.mark.parametrize("draft", [{"mode": "chain", "depth": 4},
                                   {"mode": "tree", "depth": 3, "topk": 3, "total_tokens": 10}])
def test_greedy_is_exact_with_an_eagle_drafter(tmp_path, draft):
    tgt = target("llama")
    folder = _write(tmp_path / "eagle", _eagle_config(tgt), _eagle_weights(tgt, bias=False))
    drafter = load_drafter(str(folder), tgt)
    assert not drafter.cfg.fc_bias
    engine = make_engine("llama", drafter, builtin_registry(), draft=draft)
    for prompt in ([5, 6, 7, 8], [30, 31, 9]):
        assert engine.generate(prompt, max_new_tokens=20).token_ids == reference_greedy("llama", prompt, 20)


def test_bad_eagle_checkpoints_are_refused(tmp_path):
    tgt = target("llama")
    weights = _eagle_weights(tgt)
    with pytest.raises(ArtifactMismatchError, match="its hidden_size is 64, the target's is 32"):
        load_eagle(_write(tmp_path / "wide", _eagle_config(tgt, hidden_size=64), weights), tgt.fingerprint())
    # midlayer.* makes it an EAGLE-3 checkpoint, read as one (tests/test_eagle3.py): this one has no head
    eagle3 = {**weights, "midlayer.self_attn.q_proj.weight": torch.zeros(2, 2)}
    with pytest.raises(ConfigError, match="EAGLE-3 checkpoint without its lm_head"):
        load_eagle(_write(tmp_path / "e3", _eagle_config(tgt), eagle3), tgt.fingerprint())
    partial = {k: v for k, v in weights.items() if "down_proj" not in k}
    with pytest.raises(ConfigError, match="lacks"):
        load_eagle(_write(tmp_path / "partial", _eagle_config(tgt), partial), tgt.fingerprint())
    # a .bin that would run code when unpickled is refused, not executed
    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_eagle_config(tgt)))

    class Boom:
        def __reduce__(self):
            return (print, ("this must never run",))

    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"fc.weight": Boom()}, protocol=2))
    with pytest.raises(ConfigError, match="weights_only=True"):
        load_eagle(folder, tgt.fingerprint())
