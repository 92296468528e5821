"""Where dynaspec keeps what it computes once per machine (converted targets, probe results), and
verified cache folders: a folder is built beside its final place, its ``manifest.json`` (every
file's size and whole-file checksum) written last, then renamed into place; a folder that fails its
checks is removed and rebuilt, never used."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")

MANIFEST = "manifest.json"
FULL_HASH_MAX = 64 << 20  # files up to this size get a sha256, larger ones a CRC-32
STALE_TMP_S = 6 * 3600  # leftovers of crashed builds older than this are swept away


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
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def file_check(path: Path) -> dict[str, Any]:
    """Size and a checksum of the whole file: sha256 up to 64 MiB; above (the 1 GB of weights),
    CRC-32, which reads at about 5 GB/s here (0.2 s, ~2% of a warm load) and catches any
    corruption short of a deliberate forgery."""
    size = path.stat().st_size
    small = size <= FULL_HASH_MAX
    digest = hashlib.sha256() if small else None
    crc = 0
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 24), b""):
            if small:
                digest.update(block)
            else:
                crc = zlib.crc32(block, crc)
    if small:
        return {"size": size, "sha256": digest.hexdigest()}
    return {"size": size, "crc32": f"{crc:08x}"}


def write_manifest(folder: Path, fmt: int, provenance: dict[str, Any]) -> None:
    """Write ``manifest.json`` last: every file's size and checksum, after an fsync of each."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            with path.open("rb") as fh:  # durable before the manifest vouches for it
                os.fsync(fh.fileno())
            files[path.name] = file_check(path)
    manifest = {"format": fmt, **provenance, "files": files}
    tmp = folder / (MANIFEST + ".part")
    with tmp.open("w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MANIFEST)


def folder_problem(folder: Path, fmt: int, *, required: str) -> str | None:
    """Why the cached folder cannot be used (no manifest, another ``fmt``, no ``required`` file, a
    file missing, resized or failing its checksum), or None when it passes the checks."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        return "manifest of another format"
    files = manifest.get("files")
    if not isinstance(files, dict) or required not in files:
        return f"manifest lists no {required}"
    stamps = _read_stamps(folder)
    fresh = {}
    for name, expected in files.items():
        path = folder / name
        try:
            st = path.stat()
            if st.st_size != expected.get("size"):
                return f"{name}: size differs"
            stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, expected.get("crc32")]
            if "crc32" in expected and stamps.get(name) == stamp:
                continue  # checked whole before, and not written to since (any write moves ctime)
            if file_check(path) != expected:
                return f"{name}: content check failed"
            if "crc32" in expected:
                fresh[name] = stamp
        except OSError:
            return f"{name}: missing"
    if fresh:
        _write_stamps(folder, {**stamps, **fresh})
    return None


#: beside the manifest: the stat of each large file when its checksum last passed in full, so that
#: later loads skip re-reading gigabytes (1-1.4 s of a warm start for Qwen's 2.5 GB) while the file
#: is untouched: size, mtime, ctime and inode must all still match, and any write changes ctime
VERIFIED = "verified.json"


def _read_stamps(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_stamps(folder: Path, stamps: dict[str, Any]) -> None:
    """Best effort and atomic: a folder that cannot be written is checked in full every time."""
    tmp = folder / f".{VERIFIED}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(stamps))
        os.replace(tmp, folder / VERIFIED)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def remove_folder(folder: Path) -> None:
    """Move ``folder`` out of the way atomically, then delete it."""
    trash = folder.with_name(f".{folder.name}.trash-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.replace(folder, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def sweep(parent: Path, name: str) -> None:
    """Delete the leftovers ``.<name>.*`` of crashed builds and removals beside a cached folder."""
    now = time.time()
    for path in parent.glob(f".{name}.*"):
        try:
            if ".trash-" in path.name or now - path.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def load_cached(final: Path, *, build: Callable[[Path], None], load: Callable[[Path], T],
                problem: Callable[[Path], str | None], label: str, duration: str) -> T:
    """``load(final)`` of a verified cache folder, building it first when it is missing or fails its
    checks (``problem``): ``build(tmp)`` fills a temporary folder beside ``final`` (its last step
    writes the manifest), which is then renamed into place, so a crash never leaves a half-built
    copy behind. A copy that fails its checks or does not load is named, removed and rebuilt. One
    process builds at a time (a file lock in the cache's ``locks`` folder): another that needs the same copy waits
    for it, then loads what it built."""
    import sys
    import tempfile

    from dynaspec.errors import ConfigError

    def say(msg: str) -> None:
        print(f"dynaspec: {msg}", file=sys.stderr, flush=True)

    failed = None  # why the copy in place did not load, if it did not
    if final.exists() and problem(final) is None:
        try:
            return load(final)
        except Exception as exc:  # noqa: BLE001 - any failure means: rebuild (below, under the lock)
            failed = f"loading failed ({type(exc).__name__}: {exc})"
    parent = final.parent

    def unwritable(exc: OSError) -> ConfigError:
        return ConfigError(f"cannot write the {label} cache under {parent} ({exc.strerror or exc}); "
                           "set DYNASPEC_CACHE_DIR to a writable folder")

    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise unwritable(exc) from None
    from filelock import FileLock, Timeout

    locks = cache_root() / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError:
        locks = parent
    lock = FileLock(str(locks / f"{final.parent.name}-{final.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"another process is building the {label} copy in {final}; waiting for it...")
        lock.acquire()
    try:
        # built by the process this one waited for, or left over from before: checked again
        if final.exists():
            why = failed or problem(final)
            if why is None:
                try:
                    return load(final)
                except Exception as exc:  # noqa: BLE001 - any failure means: rebuild
                    why = f"loading failed ({type(exc).__name__}: {exc})"
            say(f"cached {label} copy at {final} is unusable: {why}; rebuilding")
            remove_folder(final)
        try:
            sweep(parent, final.name)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        except OSError as exc:
            raise unwritable(exc) from None
        say(f"converting {label} (one-time, {duration}; cached in {final})...")
        try:
            build(tmp)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return load(final)
    finally:
        lock.release()
