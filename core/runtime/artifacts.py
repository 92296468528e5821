"""Reading and writing the project's safetensors artifacts (frequency lists, clusters, router).

Each artifact is one safetensors file whose metadata holds a ``format`` tag and a JSON document
that records, among other things, the fingerprint of the target it was built for. A path may name
the file or the folder that holds it under its usual file name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from dynaspec.errors import ArtifactMismatchError, ConfigError
from dynaspec.runtime.files import atomic_write


def write_artifact(path: str | Path, filename: str, fmt: str, tensors: Mapping[str, torch.Tensor],
                   info: Mapping[str, Any], *, extra: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` with ``info`` (JSON) atomically; ``path`` is a folder or a .safetensors file."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / filename
    metadata = {"format": fmt, "info": json.dumps(info, sort_keys=True), **(extra or {})}
    data = {k: v.contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda p: save_file(data, str(p), metadata=metadata))
    return path


def read_artifact(path: str | Path, filename: str, fmt: str, *, what: str,
                  fingerprint: Mapping[str, Any] | None) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, str]]:
    """(tensors, info, raw metadata); refuses another format or an artifact for another target."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        path = path / filename
    if not path.is_file():
        raise ConfigError(f"no {what} at {path}")
    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata() or {}
        if metadata.get("format") != fmt:
            raise ConfigError(f"{path}: not a dynaspec {what} (format {metadata.get('format')!r})")
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    info = json.loads(metadata.get("info", "{}"))
    if fingerprint is not None:
        check_fingerprint(info.get("target"), fingerprint, what=f"{what} {path}")
    return tensors, info, metadata


def check_fingerprint(recorded: Mapping[str, Any] | None, actual: Mapping[str, Any], *, what: str) -> None:
    """Raise :class:`ArtifactMismatchError` unless an artifact's recorded target matches ``actual``."""
    if not recorded:
        raise ArtifactMismatchError(f"{what} records no target fingerprint; rebuild it for this target")
    for key in ("model_type", "vocab_size", "hidden_size", "lm_head_sha256_rows64"):
        if key in recorded and recorded[key] != actual.get(key):
            raise ArtifactMismatchError(
                f"{what} was built for another target: {key} is {recorded[key]!r} there, "
                f"{actual.get(key)!r} for this target")
