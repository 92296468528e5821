"""Finding stacks by name or file, and the built-in stacks shipped as TOML files."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from dynaspec.errors import ConfigError
from dynaspec.runtime.config import StackConfig, merge, read_toml, stack_from_mapping
from dynaspec.runtime.registry import Registry, default_registry


def builtin_stack_mappings() -> dict[str, dict[str, Any]]:
    """The stacks in ``dynaspec/stack_files/*.toml``, by name."""
    out: dict[str, dict[str, Any]] = {}
    for entry in sorted(resources.files("dynaspec").joinpath("stack_files").iterdir(),
                        key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            data = read_toml(Path(str(entry)))
            out[data["name"]] = data
    return out


def _looks_like_file(ref: str) -> bool:
    return ref.endswith(".toml") or "/" in ref or Path(ref).is_file()


def _relative_to(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Paths written ``./x`` or ``../x`` in a stack file (the target, the drafter, component
    parameters) are relative to the file's folder, so a prepared folder can be moved whole."""
    def fix(value: Any) -> Any:
        if isinstance(value, str) and value.startswith(("./", "../")):
            return str((folder / value).resolve())
        if isinstance(value, list):  # e.g. a composite drafter's list of drafters
            return [fix(v) for v in value]
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        return value

    return {k: (v if k in ("draft", "decode") else fix(v)) for k, v in data.items()}


def _resolve_mapping(ref: str, registry: Registry, seen: tuple[str, ...]) -> dict[str, Any]:
    if ref in seen:
        raise ConfigError(f"stack 'base' cycle: {' -> '.join([*seen, ref])}")
    if Path(ref).is_dir():
        inside = sorted(p.name for p in Path(ref).glob("*.toml"))
        raise ConfigError(f"stack '{ref}' is a folder: give a stack name or a TOML file"
                          + (f" (this folder holds {', '.join(inside)})" if inside else ""))
    if _looks_like_file(ref):
        path = Path(ref)
        data = _relative_to(read_toml(path), path.parent)
        base = data.get("base")
        if isinstance(base, str) and _looks_like_file(base) and not Path(base).is_absolute():
            base = str(path.parent / base)
        data.setdefault("name", path.stem)
    else:
        data = dict(registry.get("stack", ref))
        base = data.get("base")
    if base:
        if not isinstance(base, str):
            raise ConfigError(f"stack '{ref}': 'base' must be a stack name or file")
        data = merge(_resolve_mapping(base, registry, (*seen, ref)), data)
    return data


def resolve_stack(ref: str | StackConfig, *, overrides: Mapping[str, Any] | None = None,
                  registry: Registry | None = None) -> StackConfig:
    """A stack from a built-in or plugin name, or a TOML file, with dotted-field overrides."""
    if isinstance(ref, StackConfig):
        stack = ref
    else:
        registry = registry or default_registry()
        stack = stack_from_mapping(_resolve_mapping(ref, registry, ()), source=ref)
    return stack.with_overrides(overrides) if overrides else stack
