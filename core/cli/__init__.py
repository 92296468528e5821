"""The ``dynaspec`` command line: one module per command group, assembled here.

- :mod:`~dynaspec.cli.generate`: ``generate`` (imports the runtime only);
- :mod:`~dynaspec.cli.info`: ``plugins``, ``stacks``;
- :mod:`~dynaspec.cli.train`: ``train-drafter``, ``build-frequency``, ``build-clusters``, ``train-router``;
- :mod:`~dynaspec.cli.measure`: ``eval``, ``eval-shortlist``, ``bench``, ``bench-head``;
- :mod:`~dynaspec.cli.serve`: ``serve`` (imports the runtime and :mod:`dynaspec.serving`).

Heavy imports happen inside the commands, so ``--help`` is fast. No command module imports a
component: they call the runtime, :mod:`dynaspec.training` or :mod:`dynaspec.evaluation`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from dynaspec.cli import generate, info, measure, serve, train
from dynaspec.cli.common import Parser, check_outputs
from dynaspec.errors import DynaspecError

EPILOG = """\
Stacks are chosen by name (see `dynaspec stacks`) or by a TOML file; `--set FIELD=VALUE` overrides
one field, e.g. `--set draft.depth=5 --set backend=torch`. Components come from plugins (see
`dynaspec plugins`).
"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dynaspec")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dynaspec", description="Speculative decoding with a context-aware dynamic draft vocabulary.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (generate, info, train, measure, serve):
        module.register(sub)
    _complete_help(parser)
    return parser


#: help for options whose meaning is the same wherever they appear
_COMMON_HELP = {
    "--target": "target model: a built-in name (qwen2.5-coder-0.5b, the embedded default; gemma3-270m; "
                "tiny-llama, tiny-gemma3) or a Hugging Face model folder",
    "--stage": "collect shards, train on them, or both",
    "--shard-size": "prompts per shard file (a shard is the unit of resuming)",
    "--max-prompt-tokens": "prompts are cut to this many tokens",
    "--epochs": "passes over the training data",
    "--lr": "learning rate (AdamW)",
    "--window": "training positions per sequence window",
    "--batch-positions": "positions per optimisation step",
    "--prompts": "how many dev (or train) prompts",
    "--max-new-tokens": "tokens generated per prompt",
    "--source": "raw: ShareGPT train text tokenised by the target; generated: the target's own "
                "continuations collected in --work",
    "--clusters": "number of clusters M",
    "--iterations": "k-means iterations",
    "--seed": "random seed",
    "--out": "output folder",
    "--width": "hidden width of the router's MLP",
    "--max-shards": "use the first N shards only",
    "--depth": "draft depths to evaluate",
    "--max-positions": "evaluate at most this many positions",
    "--backends": "draft-head backends to time",
    "--sizes": "shortlist sizes to time",
    "--dtypes": "dtypes to time",
    "--repeats": "timing repeats (the median is reported)",
    "--breakdown-tokens": "tokens generated per --breakdown prompt",
    "--stacks": "stack names or TOML files (the baseline is added)",
    "--limit-per-category": "at most K questions per category",
    "--temperature": "0 = greedy (outputs checked against the baseline); above 0 samples",
}


def _complete_help(parser: argparse.ArgumentParser) -> None:
    """Every option of every command has help, and says its default."""
    for action in parser._subparsers._group_actions if parser._subparsers else []:
        for sub in action.choices.values():
            for opt in sub._actions:
                if not opt.option_strings or opt.dest == "help" or opt.help == argparse.SUPPRESS:
                    continue
                if opt.help is None:
                    opt.help = next((_COMMON_HELP[o] for o in opt.option_strings if o in _COMMON_HELP), "")
                has_default = opt.default not in (None, False, []) and opt.nargs != 0
                if has_default and "default" not in opt.help:
                    opt.help = (opt.help + " " if opt.help else "") + "(default: %(default)s)"


#: commands whose process ends as soon as their output is out (see :func:`run`)
_QUICK_EXIT = ("generate",)


def run() -> None:
    """The ``dynaspec`` command: :func:`main`, then the process's exit. After ``generate`` (whose
    files are all written and closed by then), the interpreter's own teardown is skipped: with
    torch loaded it takes 0.8-1 s here, a third of a warm start, and frees nothing the operating
    system would not."""
    code = main()
    if "torch.distributed" in sys.modules:  # a command run under torchrun: leave its process group
        from dynaspec.training.distributed import leave

        leave()
    if len(sys.argv) > 1 and sys.argv[1] in _QUICK_EXIT and os.environ.get("DYNASPEC_QUICK_EXIT", "1") != "0":
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        check_outputs(args)
        if getattr(args, "threads", 0):
            import torch

            torch.set_num_threads(args.threads)
        return func(args)
    except DynaspecError as exc:
        print(f"dynaspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dynaspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (e.g. `dynaspec stacks | head`): stop quietly, as Unix tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
