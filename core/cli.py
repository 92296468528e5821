"""The ``dynaspec`` command line. Heavy imports happen inside the commands, so ``--help`` is fast."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from .errors import ConfigError, DynaspecError

EPILOG = """\
Stacks are chosen by name (see `dynaspec stacks`) or by a TOML file; `--set FIELD=VALUE` overrides
one field, e.g. `--set draft.depth=5 --set backend=torch`. Components come from plugins (see
`dynaspec plugins`).
"""


def _parse_value(text: str) -> Any:
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


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects FIELD=VALUE, got {item!r}")
        out[key.strip()] = _parse_value(value.strip())
    return out


def _read_prompt(prompt: str) -> str:
    return sys.stdin.read() if prompt == "-" else prompt


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import Engine
    from .stats import GenerationStats

    overrides = _overrides(args)
    if args.seed is not None:
        overrides["decode.seed"] = args.seed
    engine = Engine.from_stack(args.stack, overrides=overrides)
    prompt = _read_prompt(args.prompt)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, seed=args.seed)
    if args.json:
        result = engine.generate(prompt, **kwargs)
        print(json.dumps(result.to_json(), ensure_ascii=False))
        return 0
    stats = GenerationStats()
    for piece in engine.stream(prompt, stats=stats, **kwargs):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    shortlist = (f"{stats.mean_shortlist_size:,.0f}" if stats.cycles else "-")
    print(f"[{engine.stack.name}] {stats.new_tokens} new tokens, {stats.cycles} cycles, "
          f"mean accepted length {stats.mean_accepted_length:.2f}, mean shortlist {shortlist}, "
          f"{stats.tokens_per_second:.1f} tokens/s", file=sys.stderr)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from .registry import default_registry

    registry = default_registry()
    rows = []
    for info in registry.plugins:
        comps = ", ".join(f"{kind}:{name}" for kind, name in info.components) or "-"
        status = f"FAILED ({info.error})" if info.error else ("built-in" if info.builtin else "third-party")
        rows.append({"plugin": info.name, "distribution": info.distribution, "version": info.version,
                     "status": status, "components": comps})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['plugin']:<22} {row['distribution']} {row['version']:<8} [{row['status']}]  {row['components']}")
    return 0


def cmd_stacks(args: argparse.Namespace) -> int:
    from .registry import default_registry
    from .stacks import resolve_stack

    registry = default_registry()
    if args.name:
        print(json.dumps(resolve_stack(args.name, registry=registry).to_dict(), indent=2))
        return 0
    for name in registry.names("stack"):
        stack = resolve_stack(name, registry=registry)
        print(f"{name:<16} {stack.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynaspec", description="Speculative decoding with a context-aware dynamic draft vocabulary.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate a continuation of a prompt with a stack",
                         description="Generate a continuation with speculative decoding. Prints the "
                         "text, then one statistics line on stderr (or one JSON object with --json).")
    gen.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    gen.add_argument("--stack", default="default", help="stack name or TOML file (default: %(default)s)")
    gen.add_argument("--max-new-tokens", type=int, default=None, metavar="N")
    gen.add_argument("--temperature", type=float, default=None, metavar="T", help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=None, metavar="P")
    gen.add_argument("--seed", type=int, default=None, metavar="S", help="seed for sampling")
    gen.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a stack field")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")
    gen.set_defaults(func=cmd_generate)

    plug = sub.add_parser("plugins", help="list plugins, their distributions and components")
    plug.add_argument("--json", action="store_true")
    plug.set_defaults(func=cmd_plugins)

    stacks = sub.add_parser("stacks", help="list stacks, or show one resolved")
    stacks.add_argument("name", nargs="?", help="a stack name or TOML file to show in full")
    stacks.set_defaults(func=cmd_stacks)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return func(args)
    except DynaspecError as exc:
        print(f"dynaspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dynaspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
