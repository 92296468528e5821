"""Loading published EAGLE-1 / EAGLE-2 drafters as dynaspec drafters.

An EAGLE-1/2 checkpoint is a folder with a Llama-style ``config.json`` and ``model.safetensors``
(or ``pytorch_model.bin``): ``fc`` (2h -> h, with an optional bias) over ``[E(x_t), f_{t-1}]`` and
one decoder layer ``layers.0.*`` whose input norm is dropped; the token embeddings and the LM head
are the target's. That is dynaspec's drafter without its two norms, so the weights map one to one.
``.bin`` files are read with ``torch.load(weights_only=True)`` only: no pickled code runs.

EAGLE-3 checkpoints (``midlayer.*``, fused low/mid/high features, their own draft vocabulary) are
recognised and refused with a clear message: they need features this engine does not collect yet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.runtime.drafter import Drafter, DrafterConfig

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER = {"self_attn.q_proj.weight": "q_proj.weight", "self_attn.k_proj.weight": "k_proj.weight",
          "self_attn.v_proj.weight": "v_proj.weight", "self_attn.o_proj.weight": "o_proj.weight",
          "mlp.gate_proj.weight": "gate_proj.weight", "mlp.up_proj.weight": "up_proj.weight",
          "mlp.down_proj.weight": "down_proj.weight", "post_attention_layernorm.weight": "post_norm.weight",
          "input_layernorm.weight": "input_norm.weight"}
#: parts of a checkpoint that dynaspec takes from the target instead
_TARGETS_OWN = ("embed_tokens.weight", "lm_head.weight")


def is_eagle_checkpoint(directory: str | Path) -> bool:
    directory = Path(directory)
    return (directory / "config.json").is_file() and any((directory / f).is_file() for f in WEIGHT_FILES)


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(directory / "model.safetensors"))
    try:
        weights = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - anything beyond plain tensors is refused
        raise ConfigError(f"{directory / 'pytorch_model.bin'} cannot be read as plain tensors "
                          f"(weights_only=True): {exc}") from None
    if not isinstance(weights, Mapping):
        raise ConfigError(f"{directory / 'pytorch_model.bin'} holds no state dict")
    return dict(weights)


def _config(cfg: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> DrafterConfig:
    heads = int(cfg["num_attention_heads"])
    act = str(cfg.get("hidden_act", "silu"))
    if act not in ("silu", "swish"):
        raise ConfigError(f"EAGLE checkpoint with activation {act!r}: only silu is supported")
    return DrafterConfig(
        hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads), vocab_size=int(cfg["vocab_size"]),
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        activation="silu", qk_norm=False, input_norm="layers.0.input_layernorm.weight" in weights,
        output_norm="norm.weight" in weights, fc_bias="fc.bias" in weights)


def load_eagle(directory: str | Path, target_fingerprint: Mapping[str, Any],
               dtype: torch.dtype = torch.float32) -> Drafter:
    """An EAGLE-1/2 checkpoint folder as a :class:`Drafter` for the target with ``target_fingerprint``."""
    directory = Path(directory)
    cfg = json.loads((directory / "config.json").read_text())
    weights = {k.removeprefix("model."): v for k, v in _read_weights(directory).items()}
    if any(k.startswith("midlayer.") for k in weights):
        raise ConfigError(f"{directory} is an EAGLE-3 checkpoint (midlayer.*, fused target features): "
                          "not supported yet; EAGLE-1/2 checkpoints load")
    arch = _config(cfg, weights)
    for key in ("hidden_size", "vocab_size"):
        if getattr(arch, key) != target_fingerprint.get(key):
            raise ArtifactMismatchError(f"EAGLE drafter {directory} does not fit this target: its {key} is "
                                        f"{getattr(arch, key)}, the target's is {target_fingerprint.get(key)}")
    state: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in weights.items():
        if key in ("fc.weight", "fc.bias", "norm.weight"):
            state[key] = value
        elif key.startswith("layers.0.") and key[len("layers.0."):] in _LAYER:
            state["layer." + _LAYER[key[len("layers.0."):]]] = value
        elif key not in _TARGETS_OWN and not key.endswith("rotary_emb.inv_freq"):
            unknown.append(key)
    if unknown:
        raise ConfigError(f"{directory}: not an EAGLE-1/2 drafter, unexpected weights {sorted(unknown)[:6]}")
    drafter = Drafter(arch, meta={"source": {"format": "eagle", "path": directory.name, "config": cfg}})
    missing = set(drafter.state_dict()) - set(state)
    if missing:
        raise ConfigError(f"{directory}: EAGLE checkpoint lacks {sorted(missing)}")
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return drafter.to(dtype).eval()
