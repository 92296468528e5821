"""Converting a GGUF model file into a plain Hugging Face folder (the shared step of the built-in
GGUF targets): transformers reads the GGUF's tokenizer and dequantises its weights to float32,
exactly as it would on every load, once; the folder then loads in seconds."""

from __future__ import annotations

import sys
from pathlib import Path


def say(msg: str) -> None:
    print(f"dynaspec: {msg}", file=sys.stderr, flush=True)


def convert_gguf(gguf_path: Path, folder: Path) -> None:
    """Write the tokenizer and the float32 weights of ``gguf_path`` into ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    say("  converting the tokenizer...")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    say("  converting the weights (dequantised to float32)...")
    # Dequantise explicitly: with the `kernels` package installed transformers would otherwise
    # keep packed GGUF blocks, which cannot be saved and would change the numbers.
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    # The weights are plain float32 now; drop the GGUF loading state so save_pretrained accepts it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
