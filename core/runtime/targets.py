"""Loading targets and drafters by name.

Targets: any name a plugin registered through ``dynaspec_targets`` (the built-ins are in
:mod:`dynaspec.plugins.targets`), or a local Hugging Face model directory.

Drafters: a built-in artifact name (a folder under ``dynaspec/artifacts``) or a directory.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from dynaspec.errors import ConfigError, UnknownComponentError
from dynaspec.runtime.drafter import Drafter
from dynaspec.runtime.target import TargetModel

ARTIFACTS_PACKAGE_DIR = "artifacts"


def load_target(ref: str | TargetModel, *, registry=None) -> TargetModel:
    """A target by the name a plugin registered it under (``dynaspec_targets``; the built-ins are
    ``gemma3-270m``, ``tiny-llama`` and ``tiny-gemma3``), or a Hugging Face model directory (whose
    chat template, if it has one, becomes its prompt format). A loaded target is returned as is."""
    from dynaspec.runtime.registry import default_registry

    if isinstance(ref, TargetModel):
        return ref
    registry = registry or default_registry()
    if ref in registry.names("target"):
        return registry.build("target", ref, {}, None)
    path = Path(ref)
    if path.is_dir():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
        return TargetModel(model, tokenizer, name=str(path), prompt_format=chat_prompt_format(tokenizer))
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
    """Load a drafter for ``target``: a dynaspec drafter (refused if trained for another target), or
    a published EAGLE-1/2/3 checkpoint folder (refused if its sizes do not fit the target)."""
    from dynaspec.runtime.drafter import CONFIG_FILE
    from dynaspec.runtime.eagle import is_eagle_checkpoint, load_eagle

    path = resolve_artifact(ref)
    if not (path / CONFIG_FILE).exists() and is_eagle_checkpoint(path):
        return load_eagle(path, target.fingerprint(), dtype=target.dtype,
                          target_layers=len(target.decoder.layers)).to(target.device)
    return Drafter.load(path, target_fingerprint=target.fingerprint(), dtype=target.dtype).to(target.device)


def chat_prompt_format(tokenizer) -> str | None:
    """The prompt format a tokenizer's chat template writes for one user message (``{text}`` where
    the message goes, the assistant's turn opened), or None without a template. A leading BOS
    written by the template is dropped: the tokenizer adds it itself."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\u0000TEXT\u0000"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        text = text[len(bos):]
    return text.replace(marker, "{text}")
