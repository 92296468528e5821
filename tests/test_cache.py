"""Verified cache folders: a large file's checksum is read in full once, then trusted while the
file is untouched (its size, times and inode unchanged); any write to it is caught again."""

from __future__ import annotations

import json
import time

from dynaspec.runtime import cache


def _folder(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "FULL_HASH_MAX", 16)  # files above 16 bytes count as large (CRC-32)
    folder = tmp_path / "copy"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(bytes(range(256)) * 8)
    (folder / "small.json").write_text("{}")
    cache.write_manifest(folder, 1, {"source": "test"})
    return folder


def test_a_large_file_is_read_in_full_once_while_untouched(tmp_path, monkeypatch):
    folder = _folder(tmp_path, monkeypatch)
    assert not (folder / cache.VERIFIED).exists()
    assert cache.folder_problem(folder, 1, required="weights.bin") is None
    stamps = json.loads((folder / cache.VERIFIED).read_text())
    assert set(stamps) == {"weights.bin"}  # small files are hashed every time, as before
    read = []
    real = cache.file_check
    monkeypatch.setattr(cache, "file_check", lambda path: read.append(path.name) or real(path))
    assert cache.folder_problem(folder, 1, required="weights.bin") is None
    assert read == ["small.json"]  # the large file was not read again


def test_a_write_to_a_verified_file_is_caught(tmp_path, monkeypatch):
    folder = _folder(tmp_path, monkeypatch)
    assert cache.folder_problem(folder, 1, required="weights.bin") is None
    time.sleep(0.02)
    path = folder / "weights.bin"
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF  # same size, one byte flipped in place
    path.write_bytes(bytes(data))
    assert cache.folder_problem(folder, 1, required="weights.bin") == "weights.bin: content check failed"
    # a stamp that does not match the file (copied from elsewhere, or stale) is not trusted either
    (folder / cache.VERIFIED).write_text(json.dumps({"weights.bin": [1, 2, 3, 4, "00000000"]}))
    assert cache.folder_problem(folder, 1, required="weights.bin") == "weights.bin: content check failed"


def test_json_caches_persist_at_an_absolute_path(tmp_path, monkeypatch):
    """``DYNASPEC_VERDICTS_FILE`` is a path: the probe's verdicts written there are read back (a
    failed write would only be skipped, and every load would probe again)."""
    from dynaspec.runtime.batch_invariance import verdicts_file
    from dynaspec.runtime.cache import read_json, update_json

    target = tmp_path / "sub" / "verdicts.json"
    monkeypatch.setenv("DYNASPEC_VERDICTS_FILE", str(target))
    update_json(verdicts_file(), {"a": "stock"})
    update_json(verdicts_file(), {"b": "pad 2"})
    assert target.exists() and read_json(verdicts_file()) == {"a": "stock", "b": "pad 2"}
