"""The target model: any Hugging Face causal LM, driven with explicit positions, tree attention
masks and a KV cache that can keep an arbitrary subset of the tokens it just appended."""

from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F

from dynaspec.errors import ConfigError
from dynaspec.runtime.kv_buffer import KVBuffer
from dynaspec.runtime.numerics import DTYPES, HEAD_PROBE_ROWS
from dynaspec.runtime.q8 import argmax

_FULL, _SLIDING = "full_attention", "sliding_attention"

def check_device(device: str) -> None:
    """Refuse a device this torch cannot use, before any model loads."""
    kind = torch.device(device)
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"device '{device}': {why}; use device = \"cpu\" (--device cpu)")
        if kind.index is not None and kind.index >= torch.cuda.device_count():
            raise ConfigError(f"device '{device}': only {torch.cuda.device_count()} CUDA device(s) here")


@functools.cache
def kv_layer_class():
    """The Hugging Face cache layer over a :class:`~dynaspec.runtime.kv_buffer.KVBuffer`, for the
    generic forward (defined at first use: transformers is imported only by targets that need it)."""
    from transformers.cache_utils import DynamicLayer

    class KVLayer(DynamicLayer):
        """One attention layer's cache as Hugging Face expects it: ``update`` writes the new entries
        in place and returns views of the filled part; :meth:`keep` compacts kept entries in place."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.buffer = KVBuffer(capacity)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = self.buffer.append(key_states, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.buffer.length

        def keep(self, past: int, keep: torch.Tensor | None, count: int) -> None:
            """See :meth:`KVBuffer.keep`."""
            if self.is_initialized:
                self.buffer.keep(past, keep, count)
                self.keys, self.values = self.buffer.views()

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove < 0 and self.is_initialized:
                self.buffer.crop(self.buffer.length + tokens_to_remove)
                self.keys, self.values = self.buffer.views()

    return KVLayer


def _new_kv_cache(capacity: int):
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = functools.partial(kv_layer_class(), capacity)
    return cache


@attrs.define(eq=False)
class TargetPass:
    """One sequence's rows for a pass of the target (see :meth:`TargetModel.forward`): a plain
    step or a verification (or a prompt's prefill), handed over by a generation loop so that a
    driver can run the passes of several sequences together (:meth:`TargetModel.forward_many`);
    ``seconds``: the time of the pass that computed it (shared with the others in it)."""

    ids: torch.Tensor
    positions: torch.Tensor
    cache: Any
    tree_mask: torch.Tensor | None = None
    chain: bool = False
    layers: Sequence[int] | None = None
    #: the rows whose full-vocabulary logits the loop reads first (a plain step's row, a chain's
    #: rows): a driver of several passes computes them in shared head products into ``logits``
    head: Sequence[int] | None = None
    result: Any = None
    logits: torch.Tensor | None = None
    seconds: float = 0.0
    #: what the pass raised (it fails its own sequence alone)
    error: Exception | None = None

    @property
    def is_prefill(self) -> bool:
        """Several causal rows (a prompt's), neither a chain nor a tree: computed on the prefill
        kernels, as :meth:`TargetModel.forward` computes them."""
        return len(self.ids) > 1 and not self.chain and self.tree_mask is None

    def output(self) -> Any:
        """The result, or the pass's exception raised."""
        if self.error is not None:
            raise self.error
        return self.result


class TargetModel:
    """Wraps an ``AutoModelForCausalLM`` and its tokenizer.

    ``forward`` returns the final *normed* hidden states (what the LM head sees), which are both
    the drafter's features and the input of :meth:`logits`; logits are computed only for the rows
    that need them.
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, name: str = "target",
                 prompt_format: str | None = None, forward: str = "auto") -> None:
        from dynaspec.runtime.lean import lean_support
        from dynaspec.runtime.prompt import BASE_MODEL_FORMAT

        self.model = model.eval().requires_grad_(False)  # the target is never trained here
        self.tokenizer = tokenizer
        self.name = name
        #: how one user message is written for this target, ``{text}`` standing for the message
        self.prompt_format = prompt_format or BASE_MODEL_FORMAT
        self.config = model.config.get_text_config(decoder=True) if hasattr(
            model.config, "get_text_config") else model.config
        self.decoder = model.get_decoder()
        self.embedding = model.get_input_embeddings()
        self.lm_head_weight: torch.Tensor
        self.lm_head_bias: torch.Tensor | None
        self._refresh()
        self.softcap: float | None = getattr(self.config, "final_logit_softcapping", None)
        self.vocab_size = int(self.lm_head_weight.shape[0])
        self.hidden_size = int(self.lm_head_weight.shape[1])
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        layers = getattr(self.decoder, "layers", None)
        self.n_layers = len(layers) if layers is not None else int(getattr(self.config, "num_hidden_layers", 0))
        #: weights of the model, counted once (a tied embedding and head are one tensor)
        self.parameter_count = sum(p.numel() for p in model.parameters())
        self._layer_types = self._mask_layer_types()
        self._fingerprint: dict[str, Any] | None = None
        self._numerics_state()
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # which forward runs the decoder: "lean" (dynaspec.runtime.lean: fused products, no
        # per-layer module dispatch) or "generic" (the Hugging Face modules, any architecture)
        if forward not in ("auto", "lean", "generic"):
            raise ConfigError(f"forward {forward!r}: one of auto, lean, generic")
        problem = lean_support(model) if forward != "generic" else None
        if forward == "lean" and problem:
            raise ConfigError(f"target '{name}' declares the lean forward, which does not cover it: {problem}")
        self.forward_kind = "generic" if forward == "generic" or problem else "lean"
    def _numerics_state(self) -> None:
        """The numerics' state before the probe (see :meth:`make_batch_invariant`) and the weights
        setting's defaults: every target starts so, however it was loaded."""
        #: per layer shape, how rows are kept independent of the batch size (None: not probed)
        self.batch_invariance: dict[str, str] | None = None
        #: the most rows one pass of several sequences computes (:meth:`forward_many`): set by
        #: :meth:`make_batch_invariant` to the row counts its probe covered; one sequence a pass before
        self.max_pass_rows = 1
        #: the row counts up to ``max_pass_rows`` the probe verified (None: every one)
        self.pass_rows: frozenset[int] | None = None
        #: the most rows one shared head product computes: the row counts the head's probe covers
        self.max_head_rows = max(HEAD_PROBE_ROWS)
        #: every row count from 1 to this one is probed for the body and the head (set by the probe)
        self.probed_rows = 1
        self._head = None  # the probed (batch-invariant) LM-head product, once probed
        self._relaxed_head = None  # the same, unless it pads (then the stock product)
        self._certify: float | None = None  # see greedy_token
        self._rowwise = False  # attention computes a chain's rows as plain steps would
        self._lean = None  # built at the first forward, after the final cast (see _lean_decoder)
        #: the LM head already packed for its quantised kernel (a target restored from an image), or None
        self.packed_head = None
        #: which weights the lean forward and the head compute from (see :meth:`use_weights`)
        self.weights = "dtype"
        #: what ``weights = "auto"`` means for this target: the fastest setting whose quality was
        #: measured within bounds (scripts/weights_quality.py); "dtype" until someone measures it
        self.auto_weights = "dtype"
        #: under ``weights = "w8a8"``, the products kept at 16-bit activations (the int8 kernel's
        #: ``int16`` mode): any of "qkv", "o", "gate_up", "down" (every layer's) and "lm_head"; a
        #: target sets those whose inputs hold outliers that 8 bits round away (measured with
        #: scripts/activation_emulation.py)
        self.w8a8_int16: frozenset[str] = frozenset()

    def _refresh(self) -> None:
        head = self.model.get_output_embeddings()
        self.lm_head_weight = head.weight
        self.lm_head_bias = getattr(head, "bias", None)
        self.dtype = self.lm_head_weight.dtype
        self.device = self.lm_head_weight.device

    def to(self, *, dtype: torch.dtype | str | None = None,
           device: torch.device | str | None = None) -> "TargetModel":
        """Cast and/or move the model in place (returns ``self``). The fingerprint stays that of the
        weights as loaded, so artifacts built for this target keep matching after a cast."""
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ConfigError(f"dtype {dtype!r} is not supported: one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        device = torch.device(device) if device is not None else None
        if (dtype is None or dtype == self.dtype) and (device is None or device == self.device):
            return self
        if self.batch_invariance is not None:
            raise ConfigError("cast or move the target before make_batch_invariant(), not after")
        self.fingerprint()
        self.model.to(device=device, dtype=dtype)
        self._refresh()
        self._lean = None
        return self

    def use_weights(self, kind: str) -> "TargetModel":
        """Compute the lean forward and the LM head from weights of ``kind`` (returns ``self``):
        ``dtype`` (the target dtype's own), ``float16``, ``int8-head`` or ``int8``
        (:mod:`dynaspec.runtime.quantized`; a resolved setting, not ``auto``). Call it after the
        final :meth:`to` and before :meth:`make_batch_invariant`."""
        from dynaspec.runtime.quantized import WEIGHTS_CHOICES

        if kind not in WEIGHTS_CHOICES or kind == "auto":
            raise ConfigError(f"weights {kind!r}: one of {', '.join(w for w in WEIGHTS_CHOICES if w != 'auto')}")
        if kind == self.weights:
            return self
        if self.batch_invariance is not None:
            raise ConfigError("choose the target's weights before make_batch_invariant(), not after")
        if kind != "dtype" and self.forward_kind != "lean":
            raise ConfigError(f"weights = \"{kind}\" runs through the lean forward, which target '{self.name}' "
                              "does not use: use weights = \"dtype\"")
        self.weights = kind
        return self

    def make_batch_invariant(self) -> dict[str, str]:
        """Give every product its batch-invariant kernel, once, and return the verdict per product
        (:func:`dynaspec.runtime.numerics.probe`). Call it after the final :meth:`to` and
        :meth:`use_weights`; an :class:`~dynaspec.runtime.engine.Engine` always does."""
        from dynaspec.runtime import numerics

        return numerics.probe(self)

    def _build_lean(self, linear=None, compiled: bool = False):
        from dynaspec.runtime.lean import LeanDecoder, stock_linears

        return LeanDecoder(self.model, linear or stock_linears, compiled=compiled)

    def _lean_decoder(self):
        """The lean forward, built once for the target's current dtype and device."""
        if self._lean is None:
            self._lean = self._build_lean()
        return self._lean

    @property
    def batch_invariant(self) -> bool | None:
        """Whether a chain's verification reproduces plain decoding bit for bit: every probed layer
        is batch-invariant and attention runs row-wise for chains (None: not probed). A tree is
        covered with the lean forward only, whose rows attend each over its own line (the generic
        forward's masked attention lays out scattered ancestors as no plain step does)."""
        if self.batch_invariance is None:
            return None
        return not self.variant_products()

    def variant_products(self, *, strict: bool = True) -> list[str]:
        """The products (and attention) of the forward in use whose rows depend on how many rows
        are computed together, so that a verification may round otherwise than a plain step: those
        the probe found variant, and (``strict=False``, the relaxed kernels) those it padded."""
        bad = ("variant",) if strict else ("variant", "pad")
        return [name for name, verdict in self.products_in_use().items() if verdict.startswith(bad)]

    def products_in_use(self) -> dict[str, str]:
        """The probe's verdicts of the products the forward in use computes (the lean forward's
        fused products, or the Hugging Face modules'), the LM head and attention."""
        lean = self.forward_kind == "lean"
        return {name: verdict for name, verdict in (self.batch_invariance or {}).items()
                if name.startswith(("lm_head", "attention")) or name.startswith("lean ") == lean}

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

    @property
    def base_model(self) -> bool:
        """Whether this target is a base model (no chat template: its prompt format is the plain
        ``User: ...\nAssistant:`` wrapper), which completes text rather than answering;
        ``dynaspec generate`` then passes prompts as they are unless asked for ``--chat``."""
        from dynaspec.runtime.prompt import BASE_MODEL_FORMAT

        return self.prompt_format == BASE_MODEL_FORMAT

    @property
    def turn_stops(self) -> tuple[str, ...]:
        """Texts that end the answer to a prompt in this target's format: for the plain
        ``User: ...\nAssistant:`` format of a base model, the next ``User:`` turn it would invent;
        a chat template ends its turns with a token of its own (an EOS id), so none."""
        return ("\nUser:",) if self.base_model else ()

    def format_prompt(self, user_text: str) -> str:
        """The prompt the target sees for one user message, in its own ``prompt_format``; every
        command (generate, eval, bench, the drafter's training) applies this one."""
        from dynaspec.runtime.prompt import format_prompt

        return format_prompt(user_text, self.prompt_format)

    # -- computation -----------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``E(x)`` exactly as the target computes them (Gemma's scaling included)."""
        return self.embedding(ids)

    def new_cache(self, capacity: int = 256):
        """A KV cache preallocated for ``capacity`` positions (it grows if a caller goes beyond).

        Every layer keeps every position (sliding-window layers included), so rolled-back tokens
        can be dropped by index; the windows live in our masks (or, for the lean forward, in
        which keys each row attends)."""
        if self.forward_kind == "lean":
            from dynaspec.runtime.lean import LeanCache

            return LeanCache(self.n_layers, capacity)
        return _new_kv_cache(capacity)

    def fused_features(self, ids: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        """The inputs of ``layers`` at every position of one sequence ``ids`` [T], run from an empty
        cache: [T, len(layers) * d] (see :meth:`forward`)."""
        return self.forward(ids, torch.arange(len(ids), device=ids.device), self.new_cache(len(ids) + 1),
                            layers=layers)[1]

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: Any,
                tree_mask: torch.Tensor | None = None, *, chain: bool = False,
                layers: Sequence[int] | None = None, strict: bool = True) -> Any:
        """Run ``ids`` ([T]) at ``positions`` ([T]) after everything in ``cache``.

        ``tree_mask[i, j]`` (bool, [T, T]) says new token ``i`` may attend to new token ``j``; the
        default is causal. All cached tokens are visible (within a layer's sliding window).
        ``chain=True`` says the tokens follow one another (a draft chain after the cache): after
        :meth:`make_batch_invariant`, each row's attention is then computed exactly as a one-token
        step would compute it.
        Returns the normed final hidden states, [T, d]; with ``layers``, also the inputs of those
        decoder layers side by side, [T, len(layers) * d] (the fused features an EAGLE-3 drafter
        reads), as a pair. Layer index L (one past the last of the L layers) stands for the normed
        final hidden state itself, what the LM head reads.
        ``strict=False`` runs plain steps and verifications of the lean forward on the relaxed
        kernels (no padding; see :meth:`make_batch_invariant`).
        """
        from dynaspec.runtime.batch_invariance import rowwise_chain

        count = self.n_layers
        bad = [i for i in (layers or ()) if not 0 <= i <= count]
        if bad:
            raise ConfigError(f"feature layers {bad} are not layers of this target: it has {count} "
                              f"(0..{count - 1}, and {count} for its final normed hidden state)")
        if self.forward_kind == "lean":
            hidden, captured = self._lean_decoder().forward(ids, positions, cache, tree_mask, chain=chain,
                                                            layers=layers or (), strict=strict)
            if layers is None:
                return hidden
            return hidden, torch.cat([captured[i] if i < count else hidden for i in layers], dim=-1)
        past = cache.get_seq_length()
        mask = self._masks(past, positions, tree_mask)
        captured: dict[int, torch.Tensor] = {}
        hooks = [self.decoder.layers[i].register_forward_pre_hook(
            lambda _m, args, kwargs, i=i: captured.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True) for i in (layers or ()) if i < count]
        try:
            with rowwise_chain(chain and self._rowwise):
                out = self.decoder(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                                   use_cache=True, **{self._cache_kwarg: cache})
        finally:
            for hook in hooks:
                hook.remove()
        hidden = out.last_hidden_state[0]
        if layers is None:
            return hidden
        return hidden, torch.cat([captured[i][0] if i < count else hidden for i in layers], dim=-1)

    @torch.inference_mode()
    def forward_many(self, passes: Sequence["TargetPass"], *, strict: bool = True) -> None:
        """Run the plain steps, verifications and prefills of several sequences (each its own
        cache), setting each pass's ``result`` to what :meth:`forward` returns for it alone, bit for
        bit. The lean forward computes them in one pass over all the rows (see
        ``LeanDecoder.forward_many``), the plain steps and verifications in groups of at most
        :attr:`max_pass_rows` rows and of a row count the numerics probe covered
        (:attr:`pass_rows`), the prefills in the first group; otherwise each runs alone. Every pass
        must ask for the same ``layers``. A pass that raises sets its ``error`` and leaves the
        others' results as they would be without it. With several passes, the logits of every
        pass's ``head`` rows are computed too, in shared products of the probed head (at most
        :attr:`max_head_rows` rows each), into its ``logits``."""
        if not passes:
            return
        layers = passes[0].layers
        if any(p.layers != layers for p in passes):
            raise ValueError("the passes of one batch must ask for the same feature layers")

        def alone(p: TargetPass) -> None:
            try:
                p.result = self.forward(p.ids, p.positions, p.cache, p.tree_mask, chain=p.chain, layers=layers,
                                        strict=strict)
            except Exception as exc:  # noqa: BLE001 - it fails its own sequence, not the others
                p.error = exc

        if self.forward_kind != "lean" or len(passes) == 1:
            for p in passes:
                alone(p)
            return
        count = self.n_layers
        # a prefill (several causal rows) has products of its own rows (see LeanDecoder.forward_many):
        # it joins the first group, after the rows sharing products, and counts in no group's rows
        prefills = [p for p in passes if p.is_prefill]
        groups = self._pass_groups([p for p in passes if not p.is_prefill])
        if prefills:
            groups = [groups[0] + prefills, *groups[1:]] if groups else [prefills]
        for group in groups:
            lengths = [p.cache.get_seq_length() for p in group]
            try:
                hidden, captured = self._lean_decoder().forward_many(
                    torch.cat([p.ids for p in group]), torch.cat([p.positions for p in group]),
                    [(p.cache, len(p.ids), p.tree_mask, p.chain) for p in group], layers=layers or (),
                    strict=strict)
            except Exception:  # noqa: BLE001 - find the pass that fails: each again alone
                for p, length in zip(group, lengths):
                    for layer in p.cache.layers:
                        layer.crop(length)
                for p in group:
                    alone(p)
                continue
            fused = (torch.cat([captured[i] if i < count else hidden for i in layers], dim=-1)
                     if layers is not None else None)
            at = 0
            for p in group:
                rows = slice(at, at + len(p.ids))
                p.result = hidden[rows] if layers is None else (hidden[rows], fused[rows])
                at += len(p.ids)
        self._shared_head([p for p in passes if p.error is None and p.head], strict)

    def _pass_groups(self, passes: Sequence[TargetPass]) -> list[list[TargetPass]]:
        """``passes`` in groups run together: at most ``max_pass_rows`` rows each, and a row count
        the probe verified (``pass_rows``), unless a pass is alone (then it is a solo pass)."""
        def rows(group):
            return sum(len(p.ids) for p in group)

        groups: list[list[TargetPass]] = []

        def close(group):
            while group:
                k = len(group)
                while k > 1 and not (rows(group[:k]) <= self.max_pass_rows and
                                     (self.pass_rows is None or rows(group[:k]) in self.pass_rows)):
                    k -= 1
                groups.append(group[:k])
                group = group[k:]

        current: list[TargetPass] = []
        for p in passes:
            if current and rows(current) + len(p.ids) > self.max_pass_rows:
                close(current)
                current = []
            current.append(p)
        close(current)
        return groups

    def _shared_head(self, passes: Sequence[TargetPass], strict: bool) -> None:
        """The logits of the ``head`` rows of ``passes``, in products of at most ``max_head_rows``
        rows (one read of the head for several sequences); each row as it is alone (probed)."""
        if len(passes) < 2:
            return
        rows = []
        for p in passes:
            hidden = p.result[0] if isinstance(p.result, tuple) else p.result
            rows.extend(hidden[i] for i in p.head)
        parts = [self.logits(torch.stack(rows[i:i + self.max_head_rows]), strict=strict)
                 for i in range(0, len(rows), self.max_head_rows)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # vocabulary-wide rows: no copy of one
        at = 0
        for p in passes:
            p.logits = out[at:at + len(p.head)]
            at += len(p.head)

    def logits(self, hidden: torch.Tensor, *, strict: bool = True) -> torch.Tensor:
        """Full-vocabulary logits (float32) for hidden states [R, d], on the probed head (``strict``)
        or on the probed head unless it pads (relaxed)."""
        head = self._head if strict else self._relaxed_head
        if head is not None:
            # an int8 head gives float32 rounded as its dtype's output would be, without the copies
            logits = head.float_logits(hidden) if hasattr(head, "float_logits") else head(hidden).float()
        elif hidden.shape[0] > 1 and self.dtype == torch.float32 and self.device.type == "cpu":
            # float32 on a CPU: the head as the tall side of the product (262k x d times d x R)
            # reads it at several times the speed of the R x d times d x 262k form for a few rows
            logits = torch.mm(self.lm_head_weight, hidden.t()).t().contiguous()
            if self.lm_head_bias is not None:
                logits += self.lm_head_bias
        else:
            logits = F.linear(hidden, self.lm_head_weight, self.lm_head_bias).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def greedy_token(self, hidden: torch.Tensor, *, strict: bool = True) -> int:
        """``logits(hidden, strict=strict)[0].argmax()`` for one row ``hidden`` [1, d].

        Where the strict head pads (a plain step then costs a product of several rows), the
        one-row product is tried first: both are float32 sums of the same K products, each within
        ``gamma_K * sum|w_i h_i| <= gamma_K * |w| * |h|`` of the exact logit whatever the order of
        summation (gamma_K = K u / (1 - K u), u = 2**-24). When its top two logits lie further
        apart than twice that bound for the largest row norm, twice over, no kernel of that kind
        can order them otherwise, and its argmax is the padded product's. Otherwise the padded
        product decides."""
        if strict and self._certify is not None:
            top = F.linear(hidden, self.lm_head_weight)[0].topk(2)
            if float(top.values[0] - top.values[1]) > self._certify * float(hidden.double().norm()):
                return int(top.indices[0])
        return argmax(self.logits(hidden, strict=strict)[0])

    @torch.inference_mode()
    def keep(self, cache: Any, past: int, keep: Sequence[int]) -> None:
        """Roll the cache back to its first ``past`` positions plus the appended positions
        ``past + keep`` (ascending), compacting in place. A chain keeps a prefix: nothing moves."""
        keep = [int(k) for k in keep]
        moved = None if keep == list(range(len(keep))) else torch.tensor(keep, device=self.device)
        for layer in cache.layers:
            layer.keep(past, moved, len(keep))

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
        t, device = positions.numel(), positions.device
        if tree_mask is None:
            tree_mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        allowed = torch.cat([torch.ones(t, past, dtype=torch.bool, device=device), tree_mask], dim=1)
        key_pos = torch.cat([torch.arange(past, device=device), positions])
        masks = {}
        for kind in self._layer_types:
            ok = allowed
            if kind == _SLIDING:
                window = int(self.config.sliding_window)
                ok = allowed & ((positions[:, None] - key_pos[None, :]) < window)
            additive = torch.zeros(ok.shape, dtype=self.dtype, device=device)
            additive.masked_fill_(~ok, torch.finfo(self.dtype).min)
            masks[kind] = additive[None, None]
        if getattr(self.config, "layer_types", None):
            return masks
        return next(iter(masks.values()))
