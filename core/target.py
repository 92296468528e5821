"""The target model: any Hugging Face causal LM, driven with explicit positions, tree attention
masks and a KV cache that can keep an arbitrary subset of the tokens it just appended."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from .errors import ConfigError

_FULL, _SLIDING = "full_attention", "sliding_attention"


class TargetModel:
    """Wraps an ``AutoModelForCausalLM`` and its tokenizer.

    ``forward`` returns the final *normed* hidden states (what the LM head sees), which are both
    the drafter's features and the input of :meth:`logits`; logits are computed only for the rows
    that need them.
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, name: str = "target") -> None:
        self.model = model.eval().requires_grad_(False)  # the target is never trained here
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config.get_text_config(decoder=True) if hasattr(
            model.config, "get_text_config") else model.config
        self.decoder = model.get_decoder()
        self.embedding = model.get_input_embeddings()
        head = model.get_output_embeddings()
        self.lm_head_weight: torch.Tensor = head.weight
        self.lm_head_bias: torch.Tensor | None = getattr(head, "bias", None)
        self.softcap: float | None = getattr(self.config, "final_logit_softcapping", None)
        self.vocab_size = int(self.lm_head_weight.shape[0])
        self.hidden_size = int(self.lm_head_weight.shape[1])
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        self.dtype = self.lm_head_weight.dtype
        self.device = self.lm_head_weight.device
        self._layer_types = self._mask_layer_types()
        self._fingerprint: dict[str, Any] | None = None
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    # -- properties ------------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end generation (from the model's generation config)."""
        ids = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if ids is None:
            ids = getattr(self.config, "eos_token_id", None)
        if ids is None:
            return ()
        return tuple(int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids]))

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Ids a shortlist must never drop: EOS / end of turn, plus the tokenizer's EOS."""
        ids = set(self.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        return tuple(sorted(i for i in ids if 0 <= i < self.vocab_size))

    def fingerprint(self) -> dict[str, Any]:
        """Identity of the target for artifacts: architecture, vocabulary and hidden sizes, and a hash
        of the LM head (every 64th row in float32, which is enough to tell targets apart and cheap)."""
        if self._fingerprint is None:
            rows = self.lm_head_weight.detach()[::64].to(torch.float32).contiguous().cpu()
            digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:32]
            self._fingerprint = {"model_type": str(getattr(self.config, "model_type", "")),
                                 "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                                 "lm_head_sha256_rows64": digest}
        return dict(self._fingerprint)

    # -- computation -----------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``E(x)`` exactly as the target computes them (Gemma's scaling included)."""
        return self.embedding(ids)

    def new_cache(self):
        from transformers import DynamicCache

        # A plain DynamicCache keeps every position for every layer (sliding-window layers
        # included), so rolled-back tokens can be dropped by index; windows live in our masks.
        return DynamicCache()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: Any,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``ids`` ([T]) at ``positions`` ([T]) after everything in ``cache``.

        ``tree_mask[i, j]`` (bool, [T, T]) says new token ``i`` may attend to new token ``j``; the
        default is causal. All cached tokens are visible (within a layer's sliding window).
        Returns the normed final hidden states, [T, d].
        """
        past = cache.get_seq_length()
        mask = self._masks(past, positions, tree_mask)
        out = self.decoder(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                           use_cache=True, **{self._cache_kwarg: cache})
        return out.last_hidden_state[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits (float32) for hidden states [R, d]."""
        logits = F.linear(hidden, self.lm_head_weight, self.lm_head_bias).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @staticmethod
    def keep(cache: Any, past: int, keep: torch.Tensor) -> None:
        """Roll the cache back to its first ``past`` positions plus the appended positions
        ``past + keep`` (in that order)."""
        index = torch.cat([torch.arange(past, device=keep.device), past + keep])
        for layer in cache.layers:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                continue
            if index.numel() == layer.keys.shape[-2] and bool(
                    (index == torch.arange(index.numel(), device=index.device)).all()):
                continue
            layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
            layer.values = layer.values.index_select(-2, index.to(layer.values.device))

    # -- masks -------------------------------------------------------------------------------------
    def _mask_layer_types(self) -> tuple[str, ...]:
        types = getattr(self.config, "layer_types", None)
        if types:
            unknown = set(types) - {_FULL, _SLIDING}
            if unknown:
                raise ConfigError(f"target layer types {sorted(unknown)} are not supported "
                                  "(full and sliding-window attention are)")
            return tuple(sorted(set(types)))
        window = getattr(self.config, "sliding_window", None)
        if window and getattr(self.config, "use_sliding_window", True):
            return (_SLIDING,)
        return (_FULL,)

    def _masks(self, past: int, positions: torch.Tensor, tree_mask: torch.Tensor | None):
        t = positions.numel()
        if tree_mask is None:
            tree_mask = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()
        allowed = torch.cat(
            [torch.ones(t, past, dtype=torch.bool, device=positions.device), tree_mask], dim=1)
        key_pos = torch.cat([torch.arange(past, device=positions.device), positions])
        masks = {}
        for kind in self._layer_types:
            ok = allowed
            if kind == _SLIDING:
                window = int(self.config.sliding_window)
                ok = allowed & ((positions[:, None] - key_pos[None, :]) < window)
            additive = torch.zeros(ok.shape, dtype=self.dtype, device=positions.device)
            additive.masked_fill_(~ok, torch.finfo(self.dtype).min)
            masks[kind] = additive[None, None]
        if getattr(self.config, "layer_types", None):
            return masks
        return next(iter(masks.values()))
