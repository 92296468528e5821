"""Writing files so that a reader never sees a partial one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _read_umask() -> int:
    mask = os.umask(0o022)  # reading the umask sets it: set it back at once (once, at import,
    os.umask(mask)  # not beside other threads creating files)
    return mask


_UMASK = _read_umask()


def atomic_write(path: str | os.PathLike, write) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``: readers never see a partial file. The
    file gets the permissions any new file gets here (the process's umask), not the owner-only
    ones of a temporary file, so artifacts written into a shared folder stay readable."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
