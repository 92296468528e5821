"""Atomic writes: a reader never sees a partial file, a failed write leaves nothing behind, and
the file gets the permissions of any new file (the umask), not a temporary file's owner-only ones."""

from __future__ import annotations

import os
import stat

import pytest

from dynaspec.runtime import files
from dynaspec.runtime.files import atomic_write


def test_atomic_write_replaces_and_respects_the_umask(tmp_path):
    path = tmp_path / "artifact.json"
    path.write_text("old")
    atomic_write(path, lambda p: open(p, "w").write("new"))
    assert path.read_text() == "new"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~files._UMASK
    assert [p.name for p in tmp_path.iterdir()] == ["artifact.json"]  # no temporary file left


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "artifact.json"
    path.write_text("old")

    def fail(p):
        open(p, "w").write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["artifact.json"]


def test_the_umask_is_read_back_unchanged():
    mask = os.umask(0o077)
    try:
        assert files._read_umask() == 0o077
        assert os.umask(0o077) == 0o077  # still what it was
    finally:
        os.umask(mask)
