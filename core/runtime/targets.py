"""Loading targets and drafters by name.

Targets: any name a plugin registered through ``dynaspec_targets`` (the built-ins are in
:mod:`dynaspec.plugins.targets`), a local Hugging Face model directory, or a Hub id (``owner/name``,
downloaded where the network allows).

Drafters: a built-in artifact name (a folder under ``dynaspec/artifacts``), a directory, or the Hub id
of a published EAGLE checkpoint.
"""

from __future__ import annotations

import os
import re
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
    if not path.is_dir() and looks_like_hub_id(ref):
        path = hub_download(ref, "target", registered=registry.names("target"))
    if path.is_dir():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
        return TargetModel(model, tokenizer, name=str(ref), prompt_format=chat_prompt_format(tokenizer))
    raise UnknownComponentError(
        f"unknown target '{ref}': not a registered target ({', '.join(registry.names('target'))}), "
        "a model directory nor a Hugging Face Hub id (owner/name)")


def looks_like_hub_id(ref: str) -> bool:
    """``owner/name`` that is not a local path: a Hugging Face Hub repository id."""
    return bool(_HUB_ID.fullmatch(ref)) and not Path(os.path.expanduser(ref)).exists()


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_download(ref: str, what: str, *, registered=()) -> Path:
    """A Hugging Face Hub repository's model files (config, weights, tokenizer), downloaded once
    into the Hub's cache; a clear error where the network or the repository is not there."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model",
                                                           "*.txt", "*.tiktoken"]))
    except Exception as exc:  # noqa: BLE001 - offline, unknown repository, gated model, ...
        names = f" (registered: {', '.join(registered)})" if registered else ""
        raise ConfigError(f"{what} '{ref}' is not here{names} and downloading it from the Hugging Face Hub "
                          f"failed: {type(exc).__name__}: {exc}") from None


def resolve_artifact(ref: str) -> Path:
    """A built-in artifact folder by name, or an existing path."""
    builtin = Path(str(resources.files("dynaspec").joinpath(ARTIFACTS_PACKAGE_DIR, ref)))
    if "/" not in ref and builtin.exists():
        return builtin
    path = Path(os.path.expanduser(ref))
    if path.exists():
        return path
    raise ConfigError(f"artifact '{ref}' not found: neither a built-in artifact nor an existing path")


def load_drafter(ref: str, target: TargetModel, *, eagle_only: bool = False) -> Drafter:
    """Load a drafter for ``target``: a dynaspec drafter (refused if trained for another target), or
    a published EAGLE-1/2/3 checkpoint folder or Hub id (refused if its sizes do not fit the target).
    ``eagle_only`` refuses anything but an EAGLE checkpoint."""
    from dynaspec.runtime.drafter import CONFIG_FILE
    from dynaspec.runtime.eagle import is_eagle_checkpoint, load_eagle

    try:
        path = resolve_artifact(ref)
    except ConfigError:
        if not looks_like_hub_id(ref):
            raise
        path = hub_download(ref, "drafter")  # a published EAGLE checkpoint on the Hub
    if not (path / CONFIG_FILE).exists() and is_eagle_checkpoint(path):
        return load_eagle(path, target.fingerprint(), dtype=target.dtype,
                          target_layers=len(target.decoder.layers)).to(target.device)
    if eagle_only:
        raise ConfigError(f"drafter '{ref}' is not an EAGLE checkpoint (a folder with config.json and "
                          "model.safetensors): use the 'trained' drafter for dynaspec's own drafters")
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
