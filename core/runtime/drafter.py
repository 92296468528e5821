"""The EAGLE-style drafter: ``fc([E(x_t), f_{t-1}]) -> one decoder layer -> norm``, whose output
lives in the space the target's LM head reads (the target's final normed hidden state).

The drafter has no head of its own: its logits come from the target's LM head, applied by a GEMM
backend over the current shortlist only. Weights are stored as safetensors (bf16) beside a JSON
config that records the architecture and the fingerprint of the target it was trained for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.runtime.artifacts import check_fingerprint
from dynaspec.runtime.files import atomic_write
from dynaspec.runtime.kv_buffer import KVBuffer

__all__ = ["Drafter", "DrafterConfig", "DraftCache", "atomic_write", "check_drafter_shape", "check_fingerprint"]

WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter.json"
FORMAT = "dynaspec-drafter/1"


@attrs.frozen
class DrafterConfig:
    """Architecture of the drafter's single decoder layer."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    activation: str = attrs.field(default="silu")
    qk_norm: bool = False
    #: the RMS norms before the attention and after the layer, and the bias of ``fc``: all on in
    #: dynaspec's own drafters; EAGLE-1/2 checkpoints have neither norm (see dynaspec.runtime.eagle)
    input_norm: bool = True
    output_norm: bool = True
    fc_bias: bool = True
    #: EAGLE-3-style fused features: the target layers whose inputs the first draft step reads,
    #: the last being the target's layer count (its normed final hidden state, see
    #: ``TargetModel.forward``); None reads that final state alone
    feature_layers: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(int(i) for i in v))
    #: an RMS norm on the token embedding before ``fc``, as EAGLE-3 norms its embedding input: a
    #: target whose embeddings are small beside its normed hidden state (Qwen2.5-Coder-0.5B: RMS
    #: 0.017 against 6.4) otherwise gives ``fc`` the token it drafts from at a tenth of the
    #: features' size. Off in drafters trained before it existed
    embed_norm: bool = False

    @activation.validator
    def _act(self, _a, value):
        if value not in _ACTIVATIONS:
            raise ConfigError(f"drafter activation = {value!r} is invalid: one of {sorted(_ACTIVATIONS)}")

    @classmethod
    def like_target(cls, model: nn.Module, *, intermediate_size: int | None = None) -> "DrafterConfig":
        """A drafter shaped like one decoder layer of a Hugging Face target model: its sizes,
        activation and rotary base from the config, and q/k norms when the target's attention has
        them (read from its modules, whatever the model family)."""
        config = model.config
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        act = str(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu"))
        rope = getattr(cfg, "rope_theta", None)
        if rope is None:
            params = getattr(cfg, "rope_parameters", None) or {}
            if isinstance(params, Mapping) and "full_attention" in params:
                params = params["full_attention"]
            rope = (params or {}).get("rope_theta", 10000.0) if isinstance(params, Mapping) else 10000.0
        return cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(intermediate_size or cfg.intermediate_size),
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", heads) or heads),
            head_dim=head_dim,
            vocab_size=int(cfg.vocab_size),
            rope_theta=float(rope),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            activation="gelu_tanh" if "gelu" in act else "silu",
            qk_norm=any(name.endswith(".q_norm") for name, _ in model.named_modules()),
        )


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


#: cos and sin tables [P, D] per (dim, theta, device), grown by doubling: a draft step reads its
#: rows instead of computing some ten tensor operations (the same float32 values either way)
_ROPE_TABLES: dict[tuple[int, float, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_table(size: int, dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [size, D] of the rotary angles of positions ``0 .. size - 1`` (float32)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    ang = torch.arange(size, device=device, dtype=torch.float32)[:, None] * inv  # [P, D/2]
    return torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)


def _rope_angles(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, D] of the rotary angles at positions [B, T] (float32), read from a
    table of every position up to the largest (``position * inv`` is one float32 product per
    element, so a row is the same whichever table or batch it is computed in)."""
    key = (dim, float(theta), str(positions.device))
    need = int(positions.max()) + 1 if positions.numel() else 1
    table = _ROPE_TABLES.get(key)
    if table is None or table[0].shape[0] < need:
        size = max(need, 1024 if table is None else 2 * table[0].shape[0])
        table = _ROPE_TABLES[key] = _rope_table(size, dim, theta, positions.device)
    cos, sin = table
    return cos[positions][:, None], sin[positions][:, None]


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float,
          angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x [B, H, T, D] at positions [B, T]
    (``angles``: their :func:`_rope_angles`, when the caller computed them for q and k alike)."""
    dim = x.shape[-1]
    cos, sin = angles if angles is not None else _rope_angles(positions, dim, theta)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class DraftCache(KVBuffer):
    """KV cache of the drafter's one layer (:class:`~dynaspec.runtime.kv_buffer.KVBuffer`); ``crop`` drops
    the speculative entries of a cycle without copying."""


class DecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP (Llama / Gemma shaped, with optional q/k norms)."""

    def __init__(self, cfg: DrafterConfig, *, attention_input_size: int | None = None) -> None:
        super().__init__()
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        a = attention_input_size or d  # EAGLE-3 attends over [E(x), h] (2d wide)
        self.cfg = cfg
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.input_norm else nn.Identity()
        self.q_proj = nn.Linear(a, h * hd, bias=False)
        self.k_proj = nn.Linear(a, kv * hd, bias=False)
        self.v_proj = nn.Linear(a, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.act = _ACTIVATIONS[cfg.activation]
        #: products stacked into one kernel each (``qkv``, ``kv``, ``gate_up``), set on a drafter
        #: copied onto the target's quantised kernel (``quantized.fused_products``); None: apart
        self.fused: dict | None = None
        #: the compiled attention (:func:`dynaspec.runtime.q8.attend`), set on such a copy where it
        #: runs vectorised: one C call over the cache in place instead of torch's attention and its
        #: mask (a draft step runs with cold caches, after the target's pass, where each tensor
        #: operation costs several times what it does hot); None: torch's
        self.c_attend = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: DraftCache | None,
                mask: torch.Tensor | None, last: bool = False) -> torch.Tensor:
        """x [B, T, d], positions [B, T], mask bool [T, S] over (cached + new) keys or None=causal.
        ``last``: the output of the last position only ([B, 1, d]; see :meth:`attend`)."""
        out = self.attend(self.input_norm(x), positions, cache, mask, last=last)
        x = (x[:, -1:] if last else x) + out
        return x + self.mlp(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP of the post-attention norm of ``x`` (without the residual)."""
        hx = self.post_norm(x)
        if self.fused is not None:
            gate, up = self.fused["gate_up"](hx).split(self.cfg.intermediate_size, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(hx)) * self.up_proj(hx))

    def attend(self, hx: torch.Tensor, positions: torch.Tensor, cache: DraftCache | None,
               mask: torch.Tensor | None, last: bool = False) -> torch.Tensor:
        """Self-attention of the normed input ``hx`` [B, T, a], projected back to [B, T, d]
        (without the residual); the new keys and values are appended to ``cache``. ``last``: only
        the last position attends ([B, 1, d]): the others' keys and values still go to the cache,
        which is all that a pass over a prompt, or over the tokens a drafter catches up on, needs
        of them (one layer: a position's key and value depend on its own input alone)."""
        cfg = self.cfg
        b, t, _ = hx.shape
        kv_width, q = cfg.num_kv_heads * cfg.head_dim, None
        if self.fused is not None and not (last and t > 1):  # one product for q, k and v
            q, k, v = self.fused["qkv"](hx).split([cfg.num_heads * cfg.head_dim, kv_width, kv_width], dim=-1)
        elif self.fused is not None:
            k, v = self.fused["kv"](hx).split(kv_width, dim=-1)
        else:
            k, v = self.k_proj(hx), self.v_proj(hx)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        angles = _rope_angles(positions, cfg.head_dim, cfg.rope_theta)  # once for q and k
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = _rope(k, positions, cfg.rope_theta, angles)
        if last:  # the queries of the last position only
            hx, angles, t = hx[:, -1:], (angles[0][..., -1:, :], angles[1][..., -1:, :]), 1
            mask = None if mask is None else mask[-1:]
        q = (self.q_proj(hx) if q is None else q).reshape(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = _rope(q, positions, cfg.rope_theta, angles)
        if cache is not None:
            k, v = cache.append(k, v)
        if self.c_attend is not None and b == 1 and q.dtype == k.dtype:
            return self.o_proj(self._c_attention(q, k, v, mask)[None])
        rep = cfg.num_heads // cfg.num_kv_heads
        if t == 1 and mask is None:
            # one new token sees every key: each kv head's query heads become rows of one
            # unmasked product (no repeated keys, no mask; several times faster on a CPU)
            rows = q.reshape(b, cfg.num_kv_heads, rep, cfg.head_dim)
            attn = F.scaled_dot_product_attention(rows, k, v).reshape(b, cfg.num_heads, 1, cfg.head_dim)
        else:
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            if mask is None:
                s = k.shape[-2]
                mask = torch.ones(t, s, dtype=torch.bool, device=hx.device).tril(s - t)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, cfg.num_heads * cfg.head_dim))

    def _c_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
        """The rows ``q`` [1, H, T, D] over the keys and values [1, Hkv, S, D] (the cache's views)
        by the compiled attention: [T, H * D]. ``mask`` [T, S] (a tree's rows: every row sees the
        keys before the first that some row does not, then entries of its own line) or None
        (causal: row ``i`` sees the keys up to its own position, the last ``T`` being the rows')."""
        t, s = q.shape[2], k.shape[2]
        rows = q[0].transpose(0, 1).contiguous()  # [T, H, D]
        scale = self.cfg.head_dim ** -0.5
        if mask is None:
            return self.c_attend(rows, k, v, range(s - t + 1, s + 1), scale)
        # the keys every row sees form a prefix (the committed context); after it, each row's line
        unseen = mask.all(dim=0).logical_not().nonzero()
        base = int(unseen[0]) if unseen.numel() else 0
        entries = mask[:, base:].nonzero().tolist()
        lines: list[list[int]] = [[] for _ in range(t)]
        for row, col in entries:
            lines[row].append(base + col)
        return self.c_attend(rows, k, v, (), scale, lines=lines, base=base)


class Drafter(nn.Module):
    """EAGLE-style drafter: predicts the target's next normed hidden state.

    What the engine asks of any drafter (an EAGLE-3 one answers differently, see
    :mod:`dynaspec.runtime.eagle`): the target layers whose inputs it reads as features
    (``feature_layers``; None: the target's final normed hidden state), the rows its draft head
    scores (``vocabulary``; None: the target's whole vocabulary through the target's LM head), its
    own head (``head_weight``; None: the target's) and the head's input (``head_input``).
    """

    feature_layers: tuple[int, ...] | None = None
    vocabulary: torch.Tensor | None = None
    head_weight: torch.Tensor | None = None

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        """What the draft head multiplies: the drafter's output itself."""
        return out

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features in the space of the drafter's own outputs (what a router reads as
        ``h_{t-1}``): the same space for a drafter that reads the final hidden state; fused target
        layers through ``fuse`` (each slice but the last, the final state, RMS-normed first). The
        drafter's own outputs (d wide) are already in that space."""
        if self.feature_layers is None or features.shape[-1] == self.cfg.hidden_size:
            return features
        dtype = self.fuse.weight.dtype
        parts = features.to(dtype).split(self.cfg.hidden_size, dim=-1)
        normed = [norm(part) for norm, part in zip(self.layer_norms, parts[:-1])]
        return self.fuse(torch.cat([*normed, parts[-1]], dim=-1))

    def token_input(self, token_embeddings: torch.Tensor) -> torch.Tensor:
        """The token embeddings as ``fc`` reads them: through the embedding norm where the drafter
        has one (``DrafterConfig.embed_norm``), else as they are."""
        return token_embeddings if self.embed_norm is None else self.embed_norm(token_embeddings)

    def __init__(self, cfg: DrafterConfig, meta: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.meta: dict[str, Any] = dict(meta or {})
        d = cfg.hidden_size
        if cfg.feature_layers is not None:
            # fused features: the first draft step reads fuse([norm(l_1), ..., f]), deeper steps
            # their own predicted f. fuse starts as the identity on f, so an untrained fused drafter
            # is the plain one, and training adds what the lower layers hold
            self.feature_layers = cfg.feature_layers
            k = len(cfg.feature_layers)
            self.layer_norms = nn.ModuleList(RMSNorm(d, cfg.rms_norm_eps) for _ in range(k - 1))
            self.fuse = nn.Linear(k * d, d, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, (k - 1) * d:] = torch.eye(d)
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.embed_norm else None
        self.fc = nn.Linear(2 * d, d, bias=cfg.fc_bias)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.output_norm else nn.Identity()

    def forward(self, token_embeddings: torch.Tensor, features: torch.Tensor,
                positions: torch.Tensor, cache: DraftCache | None = None,
                mask: torch.Tensor | None = None, last: bool = False) -> torch.Tensor:
        """Inputs [B, T, d] (``E(x_t)``) and [B, T, d] (``f_{t-1}``, or the drafter's own
        prediction of it) or [B, T, k*d] (fused target layers) -> predicted features [B, T, d]
        (``last``: [B, 1, d], the last position's only; every position still enters ``cache``)."""
        features = self.project(features)
        x = self.fc(torch.cat([self.token_input(token_embeddings), features], dim=-1).to(self.fc.weight.dtype))
        return self.norm(self.layer(x, positions, cache, mask, last=last))

    # -- persistence -------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write ``drafter.safetensors`` + ``drafter.json`` atomically (temp files, then rename)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        config = {"format": FORMAT, "architecture": attrs.asdict(self.cfg), **self.meta}
        atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p)))
        atomic_write(directory / CONFIG_FILE,
                     lambda p: Path(p).write_text(json.dumps(config, indent=2, sort_keys=True)))

    @classmethod
    def load(cls, directory: str | os.PathLike, *, target_fingerprint: Mapping[str, Any] | None = None,
             dtype: torch.dtype = torch.float32) -> "Drafter":
        """Load a drafter; refuses one built for another target (by fingerprint)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        cfg_path, w_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        if not cfg_path.is_file() or not w_path.is_file():
            raise ConfigError(f"no drafter at {directory} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
        config = json.loads(cfg_path.read_text())
        if config.get("format") != FORMAT:
            raise ConfigError(f"{cfg_path}: not a dynaspec drafter (format {config.get('format')!r})")
        arch = DrafterConfig(**config.pop("architecture"))
        config.pop("format")
        if target_fingerprint is not None:
            check_drafter_shape(arch, target_fingerprint, what=f"drafter {directory}")
            check_fingerprint(config.get("target"), target_fingerprint, what=f"drafter {directory}")
        drafter = cls(arch, meta=config)
        drafter.load_state_dict({k: v.to(dtype) for k, v in load_file(str(w_path)).items()}, assign=True)
        return drafter.to(dtype).eval()


def check_drafter_shape(cfg: DrafterConfig, fingerprint: Mapping[str, Any], *, what: str) -> None:
    """Raise :class:`ArtifactMismatchError` unless the drafter's sizes fit the target's."""
    for key in ("hidden_size", "vocab_size"):
        if getattr(cfg, key) != fingerprint.get(key):
            raise ArtifactMismatchError(f"{what} does not fit this target: its {key} is "
                                        f"{getattr(cfg, key)}, the target's is {fingerprint.get(key)}")
