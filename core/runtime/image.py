"""Ready-to-map images of a target: what the lean forward computes from, saved once per machine and
setting, so that a warm start maps it instead of rebuilding it.

A target is loaded from its converted Hugging Face folder (float32), cast to the stack's dtype, its
weights quantised and packed for the int8 kernel; on this machine that took some 7 of the 10 s
before the first token (importing transformers' model classes, the float32 cast, the packing; see
``scripts/start_cost.py``). After that first set-up, :func:`save_image` writes what the lean forward
and the LM head read, in their run-time format (safetensors: fused weights in the stack's dtype, or
the int8 kernel's packed tiles, scales and row sums), with the architecture's numbers, the target's
identity (its fingerprint) and its tokenizer (``tokenizer.json``, read by the ``tokenizers`` library,
with the Hugging Face tokenizer saved beside it for anything else). :func:`load_image` restores an
:class:`ImageTarget` from it without transformers.

Nothing about exactness moves: the numerics probe (:func:`dynaspec.runtime.numerics.probe`) runs
on an image target as on any other, over the same kernels (remembered verdicts make it cheap), and
an image target computes bit for bit what the target it was saved from computes (tests/test_image.py).

An image is keyed by the target, the source it was converted from (the plugin's ``image_id``), the
dtype, the weights setting, the device, the int8 kernel's instruction level and the dynaspec version;
it is a verified cache folder (:mod:`dynaspec.runtime.cache`): a damaged or half-written one is
never used. ``DYNASPEC_IMAGES=0`` turns images off.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dynaspec.errors import ConfigError
from dynaspec.runtime.target import TargetModel

IMAGE_FORMAT = 3  # 2: the w8a8 products kept at 16-bit activations recorded; 3: int8-activation weights in column chunks
META = "image.json"
TENSORS = "tensors.safetensors"
TOKENIZER = "tokenizer.json"
HF_TOKENIZER = "hf-tokenizer"
_PRODUCTS = ("qkv", "o", "gate_up", "down")
_BIASES = {"qkv": "qkv_bias", "o": "o_bias", "down": "down_bias"}
#: texts on which the image's tokenizer must encode and decode exactly as the Hugging Face one
_SAMPLES = ("Hello world", "User: What is the capital of France?\nAssistant:",
            "  spaces\t\ttabs\n\n\n 😀 中文 한국어 Ñandú ü", "def f(x):\n    return x ** 2  # ok",
            "Hello , world . It 's ok ; isn't it ? Yes !", "<|im_start|>user\nhi<|im_end|>\n",
            "<start_of_turn>user\nhi<end_of_turn>\n<bos><eos>")


def enabled() -> bool:
    return os.environ.get("DYNASPEC_IMAGES", "1") not in ("0", "false", "no", "off")


def _say(msg: str) -> None:
    print(f"dynaspec: {msg}", file=sys.stderr, flush=True)


def image_dir(target: str, source_id: str, dtype: torch.dtype, weights: str, device: torch.device) -> Path:
    """``<cache root>/images/<target>-<dtype>-<weights>-<key>``, the key a hash of everything the
    image depends on."""
    import dynaspec
    from dynaspec.runtime.cache import cache_root

    dtype_name = str(dtype).removeprefix("torch.")
    level = os.environ.get("DYNASPEC_Q8_ISA") or "native"
    key = json.dumps([IMAGE_FORMAT, target, source_id, dtype_name, weights, torch.device(device).type, level,
                      dynaspec.__version__])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in target)
    return cache_root() / "images" / f"{safe}-{dtype_name}-{weights}-{digest}"


# -- the tokenizer ----------------------------------------------------------------------------------
class ImageTokenizer:
    """A target's tokenizer without transformers: encoding and decoding through the ``tokenizers``
    backend the Hugging Face tokenizer itself runs (checked equal on sample texts when the image
    was saved); every other attribute or call (a chat template, say) loads the Hugging Face
    tokenizer saved in the image, once."""

    def __init__(self, folder: Path, attributes: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_file(str(folder / TOKENIZER))
        self._folder = folder / HF_TOKENIZER
        self._attributes = dict(attributes)
        self._hf = None

    def _full(self):
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(self._folder, local_files_only=True)
        return self._hf

    def __call__(self, text, **kwargs):
        if kwargs or not isinstance(text, str):
            return self._full()(text, **kwargs)
        return {"input_ids": self._backend.encode(text).ids}

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self._full().decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __getattr__(self, name: str):
        attributes = self.__dict__.get("_attributes", {})
        if name in attributes:
            return attributes[name]
        if name.startswith("__") or "_backend" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._full(), name)


#: tokenizer attributes kept in the image (read without loading the Hugging Face tokenizer)
_TOKENIZER_ATTRIBUTES = ("eos_token_id", "bos_token_id", "pad_token_id", "eos_token", "bos_token", "chat_template")


def _same_codec(fast: ImageTokenizer, reference: Any, extra: tuple[str, ...]) -> bool:
    for text in (*_SAMPLES, *extra):
        ids = list(reference(text)["input_ids"])
        if list(fast(text)["input_ids"]) != ids:
            return False
        for skip in (False, True):
            if fast.decode(ids, skip_special_tokens=skip) != reference.decode(ids, skip_special_tokens=skip):
                return False
    return True


# -- the target ------------------------------------------------------------------------------------
class ImageTarget(TargetModel):
    """A :class:`TargetModel` restored from an image: the lean forward and the LM head over the
    saved tensors, no Hugging Face model (``model`` is None). Its dtype, device and weights setting
    are the image's."""

    def __init__(self, parts, *, meta: dict, tokenizer: Any, lm_head_weight: torch.Tensor,
                 lm_head_bias: torch.Tensor | None, packed_head: Any = None) -> None:
        self.model = None
        self.decoder = None
        self.config = None
        self.tokenizer = tokenizer
        self.name = meta["target"]
        self.prompt_format = meta["prompt_format"]
        self._parts = parts
        self.embedding = parts.embedding
        self.lm_head_weight = lm_head_weight
        self.lm_head_bias = lm_head_bias
        self.dtype = lm_head_weight.dtype
        self.device = lm_head_weight.device
        self.softcap = meta["softcap"]
        self.vocab_size = int(meta["vocab_size"])
        self.hidden_size = int(meta["hidden_size"])
        self.max_positions = int(meta["max_positions"])
        self.n_layers = len(parts.layers)
        self.parameter_count = int(meta["parameter_count"])
        self._layer_types = ()
        self._fingerprint = dict(meta["fingerprint"])
        self._eos = tuple(int(i) for i in meta["eos_token_ids"])
        self._numerics_state()
        self.packed_head = packed_head
        self._cache_kwarg = "past_key_values"
        self.forward_kind = "lean"
        self.weights = meta["weights"]
        self.auto_weights = meta["auto_weights"]
        self.w8a8_int16 = frozenset(meta["w8a8_int16"])
        #: where the image lies
        self.image = meta.get("folder")

    def to(self, *, dtype=None, device=None) -> "ImageTarget":
        from dynaspec.runtime.numerics import DTYPES

        dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if (dtype is None or dtype == self.dtype) and (device is None or torch.device(device) == self.device):
            return self
        raise ConfigError(f"target '{self.name}' was restored from an image in {self.dtype} on {self.device}: "
                          "load it from its source to cast or move it")

    def use_weights(self, kind: str) -> "ImageTarget":
        if kind != self.weights:
            raise ConfigError(f"target '{self.name}' was restored from an image with weights = \"{self.weights}\", "
                              f"not \"{kind}\"")
        return self

    def _build_lean(self, linear=None, compiled: bool = False):
        from dynaspec.runtime.lean import LeanDecoder, stock_linears
        from dynaspec.runtime.quantized import PackedWeight

        def stock(weight, bias, name=""):
            if isinstance(weight, PackedWeight):
                return (weight.kernel,) * 3
            return stock_linears(weight, bias)

        return LeanDecoder(self._parts, linear or stock, compiled=compiled)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def fingerprint(self) -> dict[str, Any]:
        return dict(self._fingerprint)


# -- saving ----------------------------------------------------------------------------------------
def _q8_state(kernel) -> tuple[dict[str, torch.Tensor], dict] | None:
    from dynaspec.runtime.q8 import Int8WeightLinear

    return kernel.state() if isinstance(kernel, Int8WeightLinear) else None


def save_image(target: TargetModel, folder: Path, *, source_id: str) -> bool:
    """Write the image of ``target`` (probed: its kernels chosen, so the packed weights exist) into
    ``folder``, atomically (built beside it, its manifest last, then renamed); True if written.
    A folder another process wrote meanwhile is kept. Nothing is written for a target without the
    lean forward or whose tokenizer the image cannot reproduce exactly (then False)."""
    from safetensors.torch import save_file

    from dynaspec.runtime.cache import cache_root, folder_problem, remove_folder, sweep, write_manifest

    if target.model is None or target.forward_kind != "lean" or target.batch_invariance is None:
        return False
    lean = target._lean_decoder()
    parts = lean.parts
    tensors: dict[str, torch.Tensor] = {}
    q8: dict[str, dict] = {}

    def put(name: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            tensors[name] = tensor.detach().contiguous()

    for i, (part, layer) in enumerate(zip(parts.layers, lean.layers)):
        for product in _PRODUCTS:
            state = _q8_state(getattr(layer, product)[1])  # the relaxed kernel: the product itself
            if state is not None:
                for key, tensor in state[0].items():
                    put(f"layers.{i}.{product}.q8.{key}", tensor)
                q8[f"layers.{i}.{product}"] = state[1]
            else:
                put(f"layers.{i}.{product}", part[product])
                if product in _BIASES:
                    put(f"layers.{i}.{product}.bias", part[_BIASES[product]])
        for j, norm in enumerate(part["norms"]):
            put(f"layers.{i}.norms.{j}", norm)
        if part["qk_norm"] is not None:
            put(f"layers.{i}.q_norm", part["qk_norm"][0])
            put(f"layers.{i}.k_norm", part["qk_norm"][1])
    put("final_norm", parts.final_norm)
    for kind, inv in parts.inv_freq.items():
        put(f"inv_freq.{kind}", inv)
    embedding = parts.embedding
    put("embedding", embedding.weight)
    scale = getattr(embedding, "embed_scale", None)
    put("embed_scale", scale if isinstance(scale, torch.Tensor) else None)
    tied = target.lm_head_weight.data_ptr() == embedding.weight.data_ptr()
    if not tied:
        put("lm_head", target.lm_head_weight)
    put("lm_head.bias", target.lm_head_bias)
    head_state = _q8_state(target._relaxed_head)
    if head_state is not None:
        for key, tensor in head_state[0].items():
            put(f"head.q8.{key}", tensor)
    tok = target.tokenizer
    meta = {
        "format": IMAGE_FORMAT, "target": target.name, "source_id": source_id,
        "dtype": str(target.dtype).removeprefix("torch."), "device": target.device.type, "weights": target.weights,
        "auto_weights": target.auto_weights, "w8a8_int16": sorted(target.w8a8_int16), "prompt_format": target.prompt_format, "softcap": target.softcap,
        "vocab_size": target.vocab_size, "hidden_size": target.hidden_size, "max_positions": target.max_positions,
        "parameter_count": target.parameter_count, "fingerprint": target.fingerprint(),
        "eos_token_ids": list(target.eos_token_ids), "parts": parts.meta(), "intermediate":
            [part["intermediate"] for part in parts.layers], "q8": q8, "head_q8": head_state[1] if head_state else None,
        "tied_head": tied, "tokenizer": None,
    }
    parent = folder.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        sweep(parent, folder.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=parent))
    except OSError as exc:
        _say(f"no image of the target saved ({exc}); starts stay slower")
        return False
    try:
        os.chmod(tmp, 0o755)
        if tok is not None:
            backend = getattr(tok, "backend_tokenizer", None)
            if backend is None:
                return False
            (tmp / TOKENIZER).write_text(backend.to_str(), encoding="utf-8")
            tok.save_pretrained(tmp / HF_TOKENIZER)
            attributes = {k: getattr(tok, k, None) for k in _TOKENIZER_ATTRIBUTES}
            fast = ImageTokenizer(tmp, attributes)
            if not _same_codec(fast, tok, (target.format_prompt("Hi"),)):
                return False
            meta["tokenizer"] = attributes
        save_file(tensors, str(tmp / TENSORS), metadata={"format": str(IMAGE_FORMAT)})
        (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        write_manifest(tmp, IMAGE_FORMAT, {"target": target.name, "source_id": source_id,
                                           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        from filelock import FileLock

        locks = cache_root() / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with FileLock(str(locks / f"images-{folder.name}.lock")):
            if folder.exists():
                if folder_problem(folder, IMAGE_FORMAT, required=TENSORS) is None:
                    return False  # another process saved it meanwhile
                remove_folder(folder)
            os.rename(tmp, folder)
            # images of the same target, dtype and weights under another key (an earlier dynaspec,
            # source or image format) would only take disk space: removed
            stem = folder.name.rsplit("-", 1)[0]
            for other in parent.glob(f"{stem}-*"):
                if other != folder and other.is_dir() and len(other.name) == len(folder.name):
                    remove_folder(other)
        return True
    except OSError as exc:
        _say(f"no image of the target saved ({exc}); starts stay slower")
        return False
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


# -- loading ---------------------------------------------------------------------------------------
def load_image(folder: Path) -> ImageTarget:
    """The :class:`ImageTarget` saved in ``folder`` (checked: its manifest, its format, every packed
    product against the kernel built here). Raises ValueError or OSError where it cannot be used."""
    from safetensors.torch import load_file

    from dynaspec.runtime.cache import folder_problem
    from dynaspec.runtime.lean import LeanParts, ScaledEmbedding
    from dynaspec.runtime.quantized import PackedWeight

    problem = folder_problem(folder, IMAGE_FORMAT, required=TENSORS)
    if problem is not None:
        raise ValueError(problem)
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != IMAGE_FORMAT:
        raise ValueError("an image of another format")
    tensors = load_file(str(folder / TENSORS))

    def kind(state: dict) -> str:  # the int8 kernel's mode says which setting packed it
        return "w8a8" if state["mode"] == "int8" else "int8"

    def product(prefix: str):
        state = meta["q8"].get(prefix)
        if state is None:
            return tensors[prefix], tensors.get(prefix + ".bias")
        from dynaspec.runtime.q8 import Int8WeightLinear

        own = {k.removeprefix(prefix + ".q8."): v for k, v in tensors.items() if k.startswith(prefix + ".q8.")}
        return PackedWeight(kind(state), Int8WeightLinear.from_state(own, state), dtype), None

    dtype = tensors["final_norm"].dtype
    pm = meta["parts"]
    layers = []
    for i, intermediate in enumerate(meta["intermediate"]):
        part = {"intermediate": int(intermediate)}
        for name in _PRODUCTS:
            weight, bias = product(f"layers.{i}.{name}")
            part[name] = weight
            if name in _BIASES:
                part[_BIASES[name]] = bias
        norms, j = [], 0
        while f"layers.{i}.norms.{j}" in tensors:
            norms.append(tensors[f"layers.{i}.norms.{j}"])
            j += 1
        part["norms"] = norms
        part["qk_norm"] = ((tensors[f"layers.{i}.q_norm"], tensors[f"layers.{i}.k_norm"])
                           if f"layers.{i}.q_norm" in tensors else None)
        layers.append(part)
    embedding = ScaledEmbedding(tensors["embedding"], tensors.get("embed_scale"))
    parts = LeanParts(**pm, inv_freq={k: tensors[f"inv_freq.{k}"] for k in pm["rope_scales"]},
                      embedding=embedding, final_norm=tensors["final_norm"], layers=layers)
    head = tensors["embedding"] if meta["tied_head"] else tensors["lm_head"]
    packed_head = None
    if meta.get("head_q8") is not None:
        from dynaspec.runtime.q8 import Int8WeightLinear

        own = {k.removeprefix("head.q8."): v for k, v in tensors.items() if k.startswith("head.q8.")}
        packed_head = PackedWeight(kind(meta["head_q8"]), Int8WeightLinear.from_state(own, meta["head_q8"]), dtype)
    tokenizer = ImageTokenizer(folder, meta["tokenizer"]) if meta.get("tokenizer") is not None else None
    meta["folder"] = str(folder)
    return ImageTarget(parts, meta=meta, tokenizer=tokenizer, lm_head_weight=head,
                       lm_head_bias=tensors.get("lm_head.bias"), packed_head=packed_head)


def find_image(folder: Path) -> ImageTarget | None:
    """The image in ``folder`` if there is a usable one; one a check refuses is removed (it is
    rebuilt after the next full load)."""
    from dynaspec.runtime.cache import remove_folder

    if not enabled() or not folder.exists():
        return None
    try:
        return load_image(folder)
    except (ValueError, OSError, KeyError) as exc:
        _say(f"the saved image of the target at {folder} is unusable ({exc}); loading the target in full")
        remove_folder(folder)
        return None
