"""Two tiny random targets for tests and demos (``tiny-llama``, ``tiny-gemma3``): built offline from
configs, with a character-level tokenizer, identical for a given seed."""

from __future__ import annotations

from typing import Any

from dynaspec.errors import ConfigError
from dynaspec.runtime.target import TargetModel


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
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
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
