"""What every command shares: option helpers, stack overrides, output checks and the parser class.

Nothing here imports torch or a component: ``dynaspec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from dynaspec.errors import ConfigError, InputError
from dynaspec.runtime.config import WEIGHTS_CHOICES


class Parser(argparse.ArgumentParser):
    """Bad arguments give one line (``dynaspec generate: error: ...``) and exit 2; ``-h`` has the rest."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def command_line() -> str:
    """The command being run, as recorded in the provenance of what it writes."""
    return "dynaspec " + " ".join(sys.argv[1:])


def parse_value(text: str) -> Any:
    """TOML-ish scalar: int, float, bool, else string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Stack overrides from ``--dtype``, ``--weights``, ``--device`` and every ``--set FIELD=VALUE``."""
    out: dict[str, Any] = {}
    for field in ("dtype", "weights", "device"):
        if getattr(args, field, None):
            out[field] = getattr(args, field)
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects FIELD=VALUE, got {item!r}")
        out[key.strip()] = parse_value(value.strip())
    return out


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(1, text)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(0, text)


def add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=non_negative_int, default=0,
                        help="torch threads (0 = torch's default); 1 suits a shared machine")


def add_placement(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="cpu, cuda or cuda:N for the target, the drafter and every tensor of the "
                        "engine (default: the stack's `device`, cpu for the built-in stacks)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                        help="the target's dtype (default: the stack's `dtype`; auto = bfloat16 where the "
                        "hardware computes it natively, else float32); the baseline it is compared with "
                        "always runs in the same dtype")
    parser.add_argument("--weights", default=None, choices=list(WEIGHTS_CHOICES),
                        help="what the target's decoder and LM head compute from (default: the stack's "
                        "`weights`; auto = the fastest setting measured within 1%% of the target's own "
                        "log-likelihood: w8a8 (int8 weights, 8-bit activations) for Qwen on x86 with "
                        "AVX-512 VNNI, int8 for Gemma and without VNNI, int8-head without a C compiler, "
                        "else dtype); the baseline it is compared with uses the same weights")


def ensure_folder(path: str, what: str) -> None:
    """Fail in one line, before any work, if the folder ``path`` could not be created or written;
    nothing is created here (a failed command leaves no empty folder behind)."""
    folder = Path(os.path.expanduser(path))
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    if not existing.is_dir():
        raise InputError(f"cannot write {what} {path}: {existing} is a file, not a folder")
    try:  # the nearest existing folder must take new entries
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".dynaspec-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"cannot write {what} {path}: {exc.strerror or exc}") from None


#: commands that read the ShareGPT data (the `data` extra), checked before any model loads
NEEDS_DATA = {"eval", "train-drafter", "prepare"}


def check_outputs(args: argparse.Namespace) -> None:
    """Fail fast on outputs that cannot be written and on a missing data extra."""
    needs_data = ((args.command in NEEDS_DATA and not getattr(args, "merge", None))
                  or (args.command == "build-frequency" and args.source == "raw"))
    if needs_data:
        from dynaspec.training.data import require_dataset

        require_dataset()
    if getattr(args, "json_out", None):
        if Path(args.json_out).expanduser().is_dir():
            raise InputError(f"--json-out {args.json_out} is a folder: name a file in it")
        ensure_folder(str(Path(args.json_out).expanduser().parent), "the folder of --json-out")
    out = getattr(args, "out", None)
    if isinstance(out, str):
        folder = Path(out).parent if out.endswith(".safetensors") else Path(out)
        ensure_folder(str(folder), "--out")
    if args.command == "train-drafter":
        for work in args.work:
            ensure_folder(work, "--work")


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically."""
    import json

    from dynaspec.runtime.files import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)  # checked writable before the work began
    atomic_write(path, lambda p: Path(p).write_text(json.dumps(data, indent=2)))


def command(sub, func, name: str, *, threads: bool = True, placement: bool = False, target: bool = False,
            **kwargs: Any) -> argparse.ArgumentParser:
    """A sub-command ``name`` that runs ``func(args)``, with ``--threads`` (``--device`` and
    ``--dtype`` with ``placement``, ``--target`` with ``target``); ``kwargs`` go to ``add_parser``
    (help; the description is ``func``'s docstring)."""
    import inspect

    if func.__doc__:
        kwargs.setdefault("description", inspect.cleandoc(func.__doc__))
    parser = sub.add_parser(name, **kwargs)
    parser.set_defaults(func=func)
    if target:
        parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    if placement:
        add_placement(parser)
    if threads:
        add_threads(parser)
    return parser
