"""A lean forward for the decoder layers of Llama-family targets (Llama, Qwen 2, Gemma 3).

The Hugging Face modules compute a decoder layer in some 50 small kernel calls, each behind
several Python layers (module calls, keyword plumbing, attention dispatch, mask builders). On a CPU
decoding one token at a time that overhead, not the weights, is most of a plain step. This module
computes the same function from the same weights in plain tensor code:

- one product for Q, K and V and one for gate and up (the weights fused once, at build);
- rotary tables computed once, read by index;
- the KV cache in :class:`~dynaspec.runtime.kv_buffer.KVBuffer`\\ s written in place;
- attention of one row as one SDPA call over the grouped query heads, keys cut to the sliding window.

**Batch invariance.** Every product goes through a ``linear`` factory, which the numerics probe
(:mod:`dynaspec.runtime.batch_invariance`) fills with a kernel whose rows do not depend on the row
count. Attention of a chain (``chain=True``) computes each row exactly as a plain step at that
position would: the same call on the same key prefix. Everything else is elementwise or reduces
within a row. A verified chain therefore reproduces plain decoding with this forward bit for bit,
wherever the probe says every product is invariant.

The Hugging Face model stays the reference: the tests check that this forward computes its
function (to float32 rounding) and gives its greedy tokens. A target whose architecture is not
covered (:func:`lean_support`) runs through the Hugging Face modules as before.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor], torch.Tensor]
#: makes the products of one weight: (strict, relaxed, any rows). The first two are kernels for the
#: rows of plain steps and verifications (strict: rows never depend on the row count; relaxed: the
#: same, unless that costs padding, see ``TargetModel.make_batch_invariant``); the third is for a
#: prefill, which plain and speculative decoding compute alike (the same weights, any kernel). A
#: factory is called with the weight, the bias and the product's name ("qkv", "o", "gate_up" or
#: "down"; a factory may treat them apart, e.g. keep one at a wider precision)
LinearFactory = Callable[[torch.Tensor, "torch.Tensor | None", str], tuple[Linear, Linear, Linear]]

_FULL, _SLIDING = "full_attention", "sliding_attention"
#: which of a layer's three kernels a pass runs on (see ``LeanDecoder.pick``)
STRICT, RELAXED, PREFILL = 0, 1, 2
_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_FAMILIES = {"llama": "llama", "qwen2": "llama", "gemma3_text": "gemma3"}


def stock_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """``F.linear`` with these weights: the kernel the probe calls ``stock``."""
    return lambda x: F.linear(x, weight, bias)


def stock_linears(weight: torch.Tensor, bias: torch.Tensor | None = None,
                  name: str = "") -> tuple[Linear, Linear, Linear]:
    """The stock kernel as every product (no probe)."""
    fn = stock_linear(weight, bias)
    return fn, fn, fn


def lean_support(model) -> str | None:
    """Why ``model`` cannot run through :class:`LeanDecoder` (None: it can)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    kind = getattr(config, "model_type", "")
    if kind not in _FAMILIES:
        return f"model type {kind!r} (the lean forward covers {', '.join(sorted(_FAMILIES))})"
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if act not in _ACTIVATIONS:
        return f"activation {act!r}"
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "use_bidirectional_attention", False):
        return "attention logit soft-capping or bidirectional attention"
    rope = getattr(config, "rope_parameters", None) or {}
    params = rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]
    if any((p or {}).get("rope_type", "default") != "default" for p in params):
        return "a rotary scaling other than the default"
    layers = model.get_decoder().layers
    if any(getattr(layer.mlp, "gate_proj", None) is None for layer in layers):
        return "an MLP without gate and up projections"
    if any(layer.mlp.gate_proj.bias is not None or layer.mlp.up_proj.bias is not None for layer in layers):
        return "biases on the MLP's gate and up projections"
    return None


class LeanCache:
    """Keys and values of every layer, each in a :class:`KVBuffer` allocated once; the target's
    ``keep`` compacts them in place (``layers[i].keep``)."""

    def __init__(self, n_layers: int, capacity: int) -> None:
        from dynaspec.runtime.kv_buffer import KVBuffer

        self.layers = [KVBuffer(capacity) for _ in range(n_layers)]

    def get_seq_length(self) -> int:
        return self.layers[0].length


def _fuse(modules, name: str) -> torch.Tensor:
    """The ``name`` tensors of ``modules`` stacked along their rows into one tensor; each module's
    own tensor becomes a view of its rows there, so the Hugging Face modules (still the reference,
    and ``generate``'s path) and the lean forward share one copy of the weights."""
    fused = torch.cat([getattr(m, name) for m in modules])
    start = 0
    for m in modules:
        rows = getattr(m, name).shape[0]
        setattr(m, name, torch.nn.Parameter(fused[start:start + rows], requires_grad=False))
        start += rows
    return fused


class ScaledEmbedding:
    """An embedding lookup, times a scale in the weight's dtype where the model has one (Gemma's
    ``sqrt(d)``), as the Hugging Face embedding computes it."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.scale = None if scale is None else scale.to(weight.dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight)
        return out if self.scale is None else out * self.scale


class LeanParts:
    """What the lean forward computes from: the architecture's numbers and the weights, as the
    model holds them (norm weights unshifted, products' weights fused). Read from a Hugging Face
    model (:meth:`from_model`) or restored from a saved image (:mod:`dynaspec.runtime.image`),
    where a product's weight may be a packed kernel state instead of a tensor."""

    #: the architecture's numbers, as saved in an image
    FIELDS = ("family", "eps", "act", "head_dim", "heads", "kv_heads", "scaling", "types", "windows",
              "rope_scales")

    def __init__(self, **fields) -> None:
        self.family: str = fields["family"]
        self.eps: float = fields["eps"]
        self.act: str = fields["act"]
        self.head_dim: int = fields["head_dim"]
        self.heads: int = fields["heads"]
        self.kv_heads: int = fields["kv_heads"]
        self.scaling: float = fields["scaling"]
        self.types: list[str] = list(fields["types"])
        self.windows: list[int | None] = list(fields["windows"])
        #: per layer type, the rotary frequencies (float32) and their attention scaling
        self.inv_freq: dict[str, torch.Tensor] = fields["inv_freq"]
        self.rope_scales: dict[str, float] = fields["rope_scales"]
        self.embedding: ScaledEmbedding | torch.nn.Module = fields["embedding"]
        self.final_norm: torch.Tensor = fields["final_norm"]
        #: per layer: qkv, qkv_bias, o, o_bias, gate_up, down, down_bias (weights), norms (list),
        #: qk_norm (pair or None), intermediate (int)
        self.layers: list[dict] = fields["layers"]

    def meta(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}

    @classmethod
    def from_model(cls, model) -> "LeanParts":
        """The parts of a Hugging Face model (its Q/K/V and gate/up weights fused in place, see
        :func:`_fuse`)."""
        problem = lean_support(model)
        if problem is not None:
            raise ValueError(f"no lean forward for this target: {problem}")
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        decoder = model.get_decoder()
        family = _FAMILIES[config.model_type]
        first = decoder.layers[0].self_attn
        types = list(getattr(config, "layer_types", None) or [_FULL] * len(decoder.layers))
        window = getattr(config, "sliding_window", None)
        layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if family == "gemma3":
                norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
            layers.append({
                "qkv": _fuse(qkv, "weight"), "qkv_bias": _fuse(qkv, "bias") if attn.q_proj.bias is not None else None,
                "o": attn.o_proj.weight, "o_bias": attn.o_proj.bias,
                "gate_up": _fuse([mlp.gate_proj, mlp.up_proj], "weight"),
                "down": mlp.down_proj.weight, "down_bias": mlp.down_proj.bias,
                "norms": [n.weight for n in norms],
                "qk_norm": (attn.q_norm.weight, attn.k_norm.weight) if family == "gemma3" else None,
                "intermediate": int(mlp.gate_proj.weight.shape[0])})
        # rotary frequencies exactly as the model holds them, one set per layer type
        rotary = decoder.rotary_emb
        inv_freq, rope_scales = {}, {}
        for kind in sorted(set(types)):
            inv = getattr(rotary, f"{kind}_inv_freq", None)
            scale = getattr(rotary, f"{kind}_attention_scaling", None)
            if inv is None:
                inv, scale = rotary.inv_freq, rotary.attention_scaling
            inv_freq[kind], rope_scales[kind] = inv.float(), float(scale)
        return cls(family=family, eps=float(config.rms_norm_eps),
                   act=getattr(config, "hidden_act", None) or config.hidden_activation,
                   head_dim=int(first.head_dim), heads=int(config.num_attention_heads),
                   kv_heads=int(config.num_key_value_heads), scaling=float(first.scaling), types=types,
                   windows=[int(window) if t == _SLIDING and window else None for t in types],
                   inv_freq=inv_freq, rope_scales=rope_scales, embedding=decoder.embed_tokens,
                   final_norm=decoder.norm.weight, layers=layers)


class _Layer:
    """One decoder layer's weights, fused, and the products that read them."""

    def __init__(self, part: dict, family: str, linear: LinearFactory) -> None:
        self.qkv_weight = part["qkv"]
        self.qkv_bias = part["qkv_bias"]
        self.gate_up_weight = part["gate_up"]
        # each product as (strict, relaxed, any rows), see LinearFactory
        self.qkv = linear(self.qkv_weight, self.qkv_bias, "qkv")
        self.o = linear(part["o"], part["o_bias"], "o")
        self.gate_up = linear(self.gate_up_weight, None, "gate_up")
        self.down = linear(part["down"], part["down_bias"], "down")
        self.intermediate = part["intermediate"]
        if family == "gemma3":  # Gemma's norms scale by (1 + w) in float32, then round once
            self.norms = [(1.0 + n.float()) for n in part["norms"]]
            self.qk_norm = tuple(1.0 + n.float() for n in part["qk_norm"])
        else:  # Llama's norms round the normed state, then scale by w in the model's dtype
            self.norms = list(part["norms"])
            self.qk_norm = None


class LeanDecoder:
    """The decoder of a Hugging Face Llama / Qwen 2 / Gemma 3 model as plain tensor code (see the
    module docstring). Build it after the model's final cast and move, from the model or from its
    :class:`LeanParts`; ``linear`` makes the product of each weight (the numerics probe's choice
    of kernel). ``compiled`` (used with ``weights = "int8"`` and ``"w8a8"``), on a CPU where the
    kernel builds: RMS norms through :func:`dynaspec.runtime.q8.rms_norm` (one call instead of
    some eight tensor operations; row-wise like the rest; each residual connection added in the
    call of the norm that reads it, :func:`~dynaspec.runtime.q8.add_rms_norm`), the rotary
    embedding through :func:`~dynaspec.runtime.q8.rope` and a SiLU-gated MLP's activation through
    :func:`~dynaspec.runtime.q8.silu_mul` (one call each, element by element), and, where it runs
    vectorised, plain steps and chains attend through :func:`dynaspec.runtime.q8.attend` (all of a
    chain's rows in one call per layer, each row as its plain step computes it; else torch's
    attention row by row)."""

    def __init__(self, model, linear: LinearFactory = stock_linears, *, compiled: bool = False) -> None:
        parts = model if isinstance(model, LeanParts) else LeanParts.from_model(model)
        self.parts = parts
        self.family = parts.family
        self.eps = parts.eps
        self.act = _ACTIVATIONS[parts.act]
        self.head_dim, self.heads, self.kv_heads = parts.head_dim, parts.heads, parts.kv_heads
        self.groups = self.heads // self.kv_heads
        self.scaling = parts.scaling
        types = parts.types
        self.windows = parts.windows
        self.layers = [_Layer(part, self.family, linear) for part in parts.layers]
        self.final_norm = parts.final_norm
        if self.family == "gemma3":
            self.final_norm = 1.0 + parts.final_norm.float()
        self.embedding = parts.embedding
        self.dtype = parts.final_norm.dtype
        self.device = parts.final_norm.device
        self._c_norm = self._c_add_norm = self._c_attend = self._c_rope = self._c_silu_mul = None
        #: the compiled norm rounds the normed row before its weight multiplies it (Llama's order)
        self._round_first = self.family != "gemma3"
        if compiled and self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16):
            from dynaspec.runtime import q8

            if q8.available() is None:
                lib = q8._library()
                self._c_norm = functools.partial(q8.rms_norm, lib=lib)
                # a residual connection and the norm after it in one call (the same bits as apart)
                self._c_add_norm = functools.partial(q8.add_rms_norm, lib=lib)
                # the rotary embedding as torch computes it, bit for bit, in one call; the gated
                # activation in one call (within float32 rounding of torch's)
                self._c_rope = functools.partial(q8.rope, lib=lib)
                if parts.act == "silu":
                    self._c_silu_mul = functools.partial(q8.silu_mul, lib=lib)
                # float32 copies of Llama's norm weights (they multiply the rounded row exactly so)
                for layer in self.layers:
                    layer.norms = [n if n.dtype == torch.float32 else n.float() for n in layer.norms]
                    if layer.qk_norm is not None:
                        layer.qk_norm = tuple(n.float() for n in layer.qk_norm)
                self.final_norm = self.final_norm.float()
                if q8.attention_available(self.head_dim, lib):
                    self._c_attend = functools.partial(q8.attend, lib=lib)
        self._inv_freq = {kind: (parts.inv_freq[kind], parts.rope_scales[kind]) for kind in set(types)}
        self._types = types
        self._tables: dict[str, torch.Tensor] = {}

    # -- pieces ------------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._c_norm is not None:
            return self._c_norm(x, weight.contiguous(), self.eps, round_first=self._round_first)
        if self.family == "gemma3":
            return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def _rotary(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] of ``positions`` for layers of ``kind`` (tables grown by doubling)."""
        need = int(positions.max()) + 1
        table = self._tables.get(kind)
        if table is None or table.shape[0] < need:
            size = max(need, 256 if table is None else 2 * table.shape[0])
            inv, scale = self._inv_freq[kind]
            freqs = torch.arange(size, device=self.device, dtype=torch.float32)[:, None] * inv.to(self.device)
            emb = torch.cat((freqs, freqs), dim=-1)
            table = torch.stack([emb.cos() * scale, emb.sin() * scale], dim=1).to(self.dtype)  # [P, 2, D]
            self._tables[kind] = table
        both = table[positions]
        return both[:, 0:1], both[:, 1:2]

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h + delta`` (``h`` itself when ``delta`` is None) and its norm by ``weight``."""
        if delta is None:
            return h, self._norm(h, weight)
        if self._c_add_norm is not None:
            return self._c_add_norm(h, delta, weight.contiguous(), self.eps, round_first=self._round_first)
        h = h + delta
        return h, self._norm(h, weight)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _attend_row(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, end: int,
                    window: int | None) -> torch.Tensor:
        """One query row [H, D] over the keys before ``end`` (within ``window``): [H * D]."""
        start = max(0, end - window) if window else 0
        q = q.view(1, self.kv_heads, self.groups, self.head_dim)
        out = F.scaled_dot_product_attention(q, keys[:, :, start:end], values[:, :, start:end], scale=self.scaling)
        return out.reshape(1, self.heads * self.head_dim)

    def _attend_line(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int, line: list[int],
                     window: int | None) -> torch.Tensor:
        """One tree row [H, D] over the keys before ``past`` and then the entries ``line`` (its
        ancestors' and its own), laid out as the plain step after the line's acceptance finds
        them: [H * D]."""
        end = past + len(line)
        start = max(0, end - window) if window else 0
        index = torch.tensor([*range(start, past), *line[max(0, start - past):]], device=q.device)
        # laid out (strides included) as the cache the plain step reads
        kbuf = torch.empty_strided(keys[:, :, :end].shape, keys.stride(), dtype=keys.dtype, device=keys.device)
        vbuf = torch.empty_strided(values[:, :, :end].shape, values.stride(), dtype=values.dtype, device=values.device)
        kbuf[:, :, start:end] = keys.index_select(2, index)
        vbuf[:, :, start:end] = values.index_select(2, index)
        return self._attend_row(q, kbuf, vbuf, end, window)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None,
                positions: torch.Tensor, past: int, lines: list[list[int]] | None, chain: bool) -> torch.Tensor:
        """Attention of the new rows ``q`` [T, H, D] over the cache ``keys``/``values`` [1, Hkv, L, D]
        (its last T entries are the new rows'): [T, H * D]. ``lines``: a draft tree's rows, each
        row's cache entries from ``past`` on (its ancestors' and its own)."""
        t, length = q.shape[0], keys.shape[2]
        if lines is not None:  # each row over the context and its own line, as the plain step after it
            if self._c_attend is not None:
                return self._c_attend(q, keys, values, (), self.scaling, window, lines=lines, base=past)
            return torch.cat([self._attend_line(q[i], keys, values, past, line, window)
                              for i, line in enumerate(lines)])
        if self._c_attend is not None and (t == 1 or chain):
            # each row over the keys up to its own position, all rows in one call
            return self._c_attend(q, keys, values, range(length - t + 1, length + 1), self.scaling, window)
        if t == 1:
            return self._attend_row(q[0], keys, values, length, window)
        if chain:  # row by row, each as the plain step at its position computes it
            return torch.cat([self._attend_row(q[i], keys, values, length - t + i + 1, window) for i in range(t)])
        if past == 0 and not window:  # a prompt's first rows: causal over their own keys alone
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, is_causal=True,
                                                 scale=self.scaling, enable_gqa=self.groups > 1)
            return out[0].transpose(0, 1).reshape(t, self.heads * self.head_dim)
        # a prefill after cached rows, or within a sliding window: causal by a mask
        allowed = torch.ones(t, length, dtype=torch.bool, device=q.device)
        allowed[:, past:] = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        if window:
            key_pos = torch.cat([torch.arange(past, device=q.device), positions])
            allowed &= (positions[:, None] - key_pos[None, :]) < window
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=allowed[None, None],
                                             scale=self.scaling, enable_gqa=self.groups > 1)
        return out[0].transpose(0, 1).reshape(t, self.heads * self.head_dim)

    # -- the forward -------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: LeanCache,
                tree_mask: torch.Tensor | None = None, *, chain: bool = False,
                layers: Sequence[int] = (), strict: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The normed final hidden states [T, d] of ``ids`` at ``positions`` after ``cache`` (see
        ``TargetModel.forward``), and the inputs of the decoder layers in ``layers``. ``strict``:
        plain steps and verifications on the strict kernels, else the relaxed ones."""
        t = ids.shape[0]
        return self._run(ids, positions, [(cache, t, tree_mask, chain)], layers,
                         [self.pick(t, tree_mask, chain, strict)])

    @staticmethod
    def pick(rows: int, tree_mask: "torch.Tensor | None", chain: bool, strict: bool) -> int:
        """Which kernels a pass of ``rows`` runs on: a plain step or a verification (rows plain
        decoding also computes one at a time) on the strict or relaxed ones, a prompt's causal
        rows (a prefill) on the prefill kernels."""
        if rows == 1 or chain or tree_mask is not None:
            return STRICT if strict else RELAXED
        return PREFILL

    def forward_many(self, ids: torch.Tensor, positions: torch.Tensor,
                     parts: Sequence[tuple[LeanCache, int, "torch.Tensor | None", bool]], *,
                     layers: Sequence[int] = (), strict: bool = True) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Plain steps, verifications and prefills of several sequences in one pass: ``ids`` and
        ``positions`` are their rows one sequence after another, ``parts`` says per sequence its
        cache, its number of rows, its tree mask and whether its rows are a chain (see
        :meth:`forward`). Each part runs on the kernels :meth:`pick` chooses for it alone. The
        plain steps' and verifications' rows share each product, on the strict (or relaxed)
        kernels, whose rows do not depend on how many are computed together; a prefill (a part of
        several causal rows) has a product of its own rows on the prefill kernels, as alone, right
        after the others' in the same layer (its weights still in the cache). Each sequence attends
        over its own cache exactly as it would alone. So each sequence's rows are the rows
        :meth:`forward` gives for it alone, bit for bit."""
        picks = [self.pick(rows, tree_mask, chain, strict) for _, rows, tree_mask, chain in parts]
        return self._run(ids, positions, parts, layers, picks)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor,
             parts: Sequence[tuple[LeanCache, int, "torch.Tensor | None", bool]], layers: Sequence[int],
             picks: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        h = self.embedding(ids)
        t = h.shape[0]
        if sum(rows for _, rows, _, _ in parts) != t:
            raise ValueError(f"the parts hold {sum(rows for _, rows, _, _ in parts)} rows, the input {t}")
        # the products' row blocks (start, end, kernels): neighbouring parts on the strict or
        # relaxed kernels share one; each prefill has its own, its rows alone as they would be
        blocks: list[list[int]] = []
        at = 0
        for (_, rows, _, _), pick in zip(parts, picks):
            if blocks and pick != PREFILL and blocks[-1][2] == pick:
                blocks[-1][1] += rows
            else:
                blocks.append([at, at + rows, pick])
            at += rows

        def product(linears, x: torch.Tensor) -> torch.Tensor:
            if len(blocks) == 1:
                return linears[blocks[0][2]](x)
            return torch.cat([linears[pick](x[a:b]) for a, b, pick in blocks])

        bounds, at = [], 0
        lines = []  # per sequence: its tree rows' cache entries from its past on (None: no tree)
        for cache, rows, tree_mask, _ in parts:
            past = cache.get_seq_length()
            bounds.append((at, at + rows, past))
            lines.append(None if tree_mask is None else
                         [(past + torch.nonzero(tree_mask[i]).flatten()).tolist() for i in range(rows)])
            at += rows
        hd, hq, hkv = self.head_dim, self.heads, self.kv_heads
        rotary = {kind: self._rotary(kind, positions) for kind in set(self._types)}
        captured = {}
        pending = None  # the last layer's residual, added where the next norm reads the sum
        for index, (layer, kind, window) in enumerate(zip(self.layers, self._types, self.windows)):
            h, x = self._add_norm(h, pending, layer.norms[0])
            if index in layers:
                captured[index] = h
            qkv = product(layer.qkv, x)
            qk = qkv[:, :(hq + hkv) * hd].view(t, hq + hkv, hd)
            v = qkv[:, (hq + hkv) * hd:].view(t, hkv, hd)
            if layer.qk_norm is not None:
                qk = torch.cat([self._norm(qk[:, :hq], layer.qk_norm[0]), self._norm(qk[:, hq:], layer.qk_norm[1])],
                               dim=1)
            cos, sin = rotary[kind]
            qk = self._c_rope(qk, cos, sin) if self._c_rope is not None else self._rotate(qk, cos, sin)
            outs = []
            for (cache, _, _, chain), (a, b, past), tree in zip(parts, bounds, lines):
                keys, values = cache.layers[index].append(qk[a:b, hq:].transpose(0, 1)[None],
                                                          v[a:b].transpose(0, 1)[None])
                outs.append(self._attend(qk[a:b, :hq], keys, values, window, positions[a:b], past, tree, chain))
            attn = product(layer.o, outs[0] if len(outs) == 1 else torch.cat(outs))
            if self.family == "gemma3":
                h, x = self._add_norm(h, self._norm(attn, layer.norms[1]), layer.norms[2])
            else:
                h, x = self._add_norm(h, attn, layer.norms[1])
            gate_up = product(layer.gate_up, x)
            if self._c_silu_mul is not None:
                mlp = product(layer.down, self._c_silu_mul(gate_up, layer.intermediate))
            else:
                mlp = product(layer.down, self.act(gate_up[:, :layer.intermediate]) * gate_up[:, layer.intermediate:])
            pending = self._norm(mlp, layer.norms[3]) if self.family == "gemma3" else mlp
        return self._add_norm(h, pending, self.final_norm)[1], captured
