"""``dynaspec plugins`` and ``dynaspec stacks``: what is installed, and what a stack resolves to."""

from __future__ import annotations

import argparse
import json

from dynaspec.cli.common import command


def register(sub) -> None:
    plug = command(sub, cmd_plugins, "plugins", threads=False,
        help="list plugins, their distributions and components")
    plug.add_argument("--json", action="store_true",
                      help="print a JSON list (plugin, distribution, version, status, components)")

    stacks = command(sub, cmd_stacks, "stacks", threads=False,
        help="list stacks, or show one resolved")
    stacks.add_argument("name", nargs="?", help="a stack name or TOML file to show in full")


def cmd_plugins(args: argparse.Namespace) -> int:
    from dynaspec.runtime.registry import default_registry

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
    headers = {"plugin": "PLUGIN", "distribution": "DISTRIBUTION", "version": "VERSION", "status": "STATUS"}
    widths = {k: max(len(headers[k]), *(len(str(r[k])) for r in rows)) if rows else len(headers[k])
              for k in headers}
    for row in [{**headers, "components": "COMPONENTS"}, *rows]:
        print("  ".join(f"{str(row[k]):<{widths[k]}}" for k in headers) + "  " + row["components"])
    targets = registry.names("target")
    if targets:  # which model each target is, and where its weights come from
        print("\nTARGETS")
        width = max(map(len, targets)) + 2
        for name in targets:
            print(f"{name:<{width}}{registry.get('target', name).description}")
    return 0


def cmd_stacks(args: argparse.Namespace) -> int:
    from dynaspec.runtime.registry import default_registry
    from dynaspec.runtime.stacks import resolve_stack

    registry = default_registry()
    if args.name:
        print(json.dumps(resolve_stack(args.name, registry=registry).to_dict(), indent=2))
        return 0
    names = registry.names("stack")
    width = max(map(len, names), default=0) + 2
    for name in names:
        stack = resolve_stack(name, registry=registry)
        print(f"{name:<{width}}{stack.description}")
    return 0
