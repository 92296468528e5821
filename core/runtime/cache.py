"""Where dynaspec keeps what it computes once per machine (the converted target, probe results)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """``$DYNASPEC_CACHE_DIR`` if set, else ``platformdirs.user_cache_dir("dynaspec")``."""
    env = os.environ.get("DYNASPEC_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("dynaspec"))


def read_json(name: str) -> dict[str, Any]:
    """A JSON object kept in the cache root, or {} if it is missing or unreadable."""
    try:
        data = json.loads((cache_root() / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_json(name: str, entries: dict[str, Any]) -> None:
    """Merge ``entries`` into a JSON object in the cache root, atomically; a cache that cannot be
    written is skipped (it only saves time)."""
    import tempfile

    path = cache_root() / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**read_json(name), **entries}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass
