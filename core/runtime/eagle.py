"""Loading published EAGLE-1 / EAGLE-2 / EAGLE-3 drafters as dynaspec drafters.

An EAGLE-1/2 checkpoint is a folder with a Llama-style ``config.json`` and ``model.safetensors``
(or ``pytorch_model.bin``): ``fc`` (2h -> h, with an optional bias) over ``[E(x_t), f_{t-1}]`` and
one decoder layer ``layers.0.*`` whose input norm is dropped; the token embeddings and the LM head
are the target's. That is dynaspec's drafter without its two norms, so the weights map one to one.

An EAGLE-3 checkpoint has the same files with other weights (:class:`Eagle3Drafter`): ``fc``
(3h -> h) fuses the inputs of three target layers (low, middle, high: by default layers 2, L/2 and
L-3 of an L-layer target, or ``eagle_aux_hidden_state_layer_ids`` from its config); ``midlayer.*``
is one decoder layer whose attention reads ``[norm(E(x_t)), norm(h_{t-1})]`` (2h wide); ``norm``
and ``lm_head`` score a draft vocabulary of its own, mapped to the target's ids by ``d2t``
(target id = draft id + ``d2t[draft id]``). Deeper draft steps feed the layer's own output back
as ``h``. The draft vocabulary is the drafter's ``vocabulary``: the ``full`` shortlister means all
of it, and any other shortlister's ids are kept where they fall inside it.

``.bin`` files are read with ``torch.load(weights_only=True)`` only: no pickled code runs.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch
from torch import nn

from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.runtime.drafter import DecoderLayer, Drafter, DrafterConfig, RMSNorm

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_LAYER = {"self_attn.q_proj.weight": "q_proj.weight", "self_attn.k_proj.weight": "k_proj.weight",
          "self_attn.v_proj.weight": "v_proj.weight", "self_attn.o_proj.weight": "o_proj.weight",
          "mlp.gate_proj.weight": "gate_proj.weight", "mlp.up_proj.weight": "up_proj.weight",
          "mlp.down_proj.weight": "down_proj.weight", "post_attention_layernorm.weight": "post_norm.weight",
          "input_layernorm.weight": "input_norm.weight"}
#: the drafter's own state names of a checkpoint's decoder-layer weights
_LAYER_STATE = {k: "layer." + v for k, v in _LAYER.items()}
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
               dtype: torch.dtype = torch.float32, *, target_layers: int | None = None) -> Drafter:
    """An EAGLE-1/2/3 checkpoint folder as a drafter for the target with ``target_fingerprint``
    (``target_layers``: its number of decoder layers, which places EAGLE-3's default features)."""
    directory = Path(directory)
    cfg = json.loads((directory / "config.json").read_text())
    weights = {k.removeprefix("model."): v for k, v in _read_weights(directory).items()}
    if any(k.startswith("midlayer.") for k in weights):
        return _load_eagle3(directory, cfg, weights, target_fingerprint, target_layers).to(dtype).eval()
    arch = _config(cfg, weights)
    _check_fits(directory, arch, target_fingerprint)
    drafter = Drafter(arch, meta={"source": {"format": "eagle", "path": directory.name, "config": cfg}})
    _load_weights(drafter, weights, directory, kind="EAGLE-1/2", top=("fc.weight", "fc.bias", "norm.weight"),
                  layer_prefix="layers.0.", layer_map=_LAYER_STATE, ignored=_TARGETS_OWN)
    return drafter.to(dtype).eval()


def _load_weights(drafter: Drafter, weights: Mapping[str, torch.Tensor], directory: Path, *, kind: str,
                  top: tuple[str, ...], layer_prefix: str, layer_map: Mapping[str, str],
                  ignored: tuple[str, ...]) -> None:
    """Map a checkpoint's names onto the drafter's (``top`` as they are, ``layer_prefix`` + a key of
    ``layer_map`` to its value; ``ignored`` and rotary tables skipped) and load them; anything else,
    or anything missing, is refused."""
    state: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in weights.items():
        if key in top:
            state[key] = value
        elif key.startswith(layer_prefix) and key[len(layer_prefix):] in layer_map:
            state[layer_map[key[len(layer_prefix):]]] = value
        elif key not in ignored and not key.endswith("rotary_emb.inv_freq"):
            unknown.append(key)
    if unknown:
        raise ConfigError(f"{directory}: not an {kind} drafter, unexpected weights {sorted(unknown)[:6]}")
    missing = set(drafter.state_dict()) - set(state)
    if missing:
        raise ConfigError(f"{directory}: {kind} checkpoint lacks {sorted(missing)}")
    drafter.load_state_dict(state)


def _check_fits(directory: Path, arch: DrafterConfig, fingerprint: Mapping[str, Any]) -> None:
    for key in ("hidden_size", "vocab_size"):
        if getattr(arch, key) != fingerprint.get(key):
            raise ArtifactMismatchError(f"EAGLE drafter {directory} does not fit this target: its {key} is "
                                        f"{getattr(arch, key)}, the target's is {fingerprint.get(key)}")


class Eagle3Drafter(Drafter):
    """An EAGLE-3 drafter (see the module's docstring). ``forward`` takes the fused target features
    (3h wide) or its own earlier outputs (h wide) and returns its pre-norm output, which is both the
    next step's ``h`` and, through :meth:`head_input` and its own head, the draft logits."""

    def __init__(self, cfg: DrafterConfig, *, draft_vocab_size: int, feature_layers: tuple[int, ...],
                 target_hidden_size: int, fc_bias: bool = False, meta: Mapping[str, Any] | None = None) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.meta = dict(meta or {})
        self.feature_layers = tuple(feature_layers)
        self.fc = nn.Linear(len(self.feature_layers) * target_hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layer = DecoderLayer(cfg, attention_input_size=2 * cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab_size, bias=False)
        #: the target id of each draft-vocabulary row
        self.register_buffer("draft_ids", torch.arange(draft_vocab_size), persistent=False)

    @property
    def vocabulary(self) -> torch.Tensor:  # type: ignore[override]
        return self.draft_ids

    @property
    def head_weight(self) -> torch.Tensor:  # type: ignore[override]
        return self.lm_head.weight

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Fused target features through ``fc``; the drafter's own outputs are already h wide."""
        h = features.to(self.fc.weight.dtype)
        return self.fc(h) if h.shape[-1] != self.cfg.hidden_size else h

    def forward(self, token_embeddings: torch.Tensor, features: torch.Tensor,
                positions: torch.Tensor, cache=None, mask: torch.Tensor | None = None,
                last: bool = False) -> torch.Tensor:
        dtype = self.fc.weight.dtype
        h = self.project(features)
        attn_in = torch.cat([self.layer.input_norm(token_embeddings.to(dtype)), self.hidden_norm(h)], dim=-1)
        out = self.layer.attend(attn_in, positions, cache, mask, last=last)
        x = (h[:, -1:] if last else h) + out
        return x + self.layer.mlp(x)


_EAGLE3_STATE = {**_LAYER_STATE, "hidden_norm.weight": "hidden_norm.weight"}  # its own norm of h


def _load_eagle3(directory: Path, cfg: Mapping[str, Any], weights: dict[str, torch.Tensor],
                 fingerprint: Mapping[str, Any], target_layers: int | None) -> Eagle3Drafter:
    arch = attrs.evolve(_config(cfg, weights), input_norm=True, output_norm=True, fc_bias="fc.bias" in weights)
    _check_fits(directory, arch, fingerprint)
    if "lm_head.weight" not in weights:
        raise ConfigError(f"{directory}: EAGLE-3 checkpoint without its lm_head.weight")
    draft_vocab = int(weights["lm_head.weight"].shape[0])
    if int(cfg.get("draft_vocab_size", draft_vocab)) != draft_vocab:
        raise ConfigError(f"{directory}: config says draft_vocab_size {cfg['draft_vocab_size']}, "
                          f"lm_head.weight has {draft_vocab} rows")
    layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layers is None:
        if target_layers is None:
            raise ConfigError(f"{directory}: EAGLE-3 needs the target's number of layers to place its features")
        layers = (2, target_layers // 2, target_layers - 3)
    layers = tuple(int(i) for i in layers)
    if target_layers is not None and not all(0 <= i < target_layers for i in layers):
        raise ArtifactMismatchError(f"EAGLE-3 drafter {directory} reads target layers {list(layers)}, "
                                    f"but the target has {target_layers}")
    fc = weights.get("fc.weight")
    target_hidden = int(cfg.get("target_hidden_size") or arch.hidden_size)
    if fc is None or tuple(fc.shape) != (arch.hidden_size, len(layers) * target_hidden):
        raise ArtifactMismatchError(
            f"EAGLE-3 drafter {directory}: fc.weight is {None if fc is None else tuple(fc.shape)}, expected "
            f"{(arch.hidden_size, len(layers) * target_hidden)} ({len(layers)} target layers of {target_hidden})")
    if target_hidden != fingerprint.get("hidden_size"):
        raise ArtifactMismatchError(f"EAGLE-3 drafter {directory} reads features {target_hidden} wide, the "
                                    f"target's hidden size is {fingerprint.get('hidden_size')}")
    if cfg.get("rope_scaling"):
        warnings.warn(f"{directory}: rope_scaling {cfg['rope_scaling']} is ignored by the draft layer "
                      "(output stays exact; acceptance may drop on long contexts)", stacklevel=3)
    drafter = Eagle3Drafter(arch, draft_vocab_size=draft_vocab, feature_layers=layers,
                            target_hidden_size=target_hidden, fc_bias=arch.fc_bias,
                            meta={"source": {"format": "eagle3", "path": directory.name, "config": dict(cfg)}})
    _load_weights(drafter, weights, directory, kind="EAGLE-3",
                  top=("fc.weight", "fc.bias", "norm.weight", "lm_head.weight"), layer_prefix="midlayer.",
                  layer_map=_EAGLE3_STATE, ignored=("d2t", "t2d", "embed_tokens.weight"))
    d2t = weights.get("d2t")
    if d2t is None:
        if draft_vocab != fingerprint.get("vocab_size"):
            raise ConfigError(f"{directory}: a draft vocabulary of {draft_vocab} rows needs its d2t map")
        ids = torch.arange(draft_vocab)
    else:
        if d2t.shape != (draft_vocab,):
            raise ConfigError(f"{directory}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
        ids = torch.arange(draft_vocab) + d2t.long()
    vocab = int(fingerprint.get("vocab_size") or 0)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel()):
        raise ArtifactMismatchError(f"EAGLE-3 drafter {directory}: its d2t map does not give distinct ids "
                                    f"of this target's vocabulary of {vocab}")
    drafter.draft_ids = ids
    return drafter
