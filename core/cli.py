"""The ``dynaspec`` command line. Heavy imports happen inside the commands, so ``--help`` is fast."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from .errors import ConfigError, DynaspecError, InputError

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
    for field in ("dtype", "device"):
        if getattr(args, field, None):
            out[field] = getattr(args, field)
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects FIELD=VALUE, got {item!r}")
        out[key.strip()] = _parse_value(value.strip())
    return out


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _decode_utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"the prompt from {where} is not UTF-8 text (byte {exc.start}: "
                         f"{data[exc.start:exc.start + 1]!r})") from None


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the argument, standard input ('-') or --prompt-file; checked to be
    non-empty UTF-8 text before any model is loaded."""
    from pathlib import Path

    if args.prompt_file is not None and args.prompt is not None:
        raise InputError("give the prompt as an argument or with --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            data = Path(args.prompt_file).read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read --prompt-file {args.prompt_file}: {exc.strerror}") from None
        prompt = _decode_utf8(data, args.prompt_file)
    elif args.prompt == "-":
        prompt = _decode_utf8(sys.stdin.buffer.read(), "standard input")
    elif args.prompt is None:
        raise InputError("no prompt: give it as an argument, '-' for standard input, or --prompt-file")
    else:
        prompt = args.prompt
    if not prompt.strip():
        raise InputError("the prompt is empty")
    return prompt


def cmd_generate(args: argparse.Namespace) -> int:
    import attrs

    from .engine import Engine
    from .registry import default_registry
    from .stacks import resolve_stack
    from .stats import GenerationStats

    # everything that can be checked is checked before the model loads (10-30 s)
    prompt = _read_prompt(args)
    overrides = _overrides(args)
    if args.seed is not None:
        overrides["decode.seed"] = args.seed
    registry = default_registry()
    stack = resolve_stack(args.stack, overrides=overrides, registry=registry)
    registry.check_stack(stack)
    decode = stack.decode
    attrs.evolve(decode, **{k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                              ("max_new_tokens", args.max_new_tokens)) if v is not None})
    if any(not s for s in args.stop):
        raise InputError("--stop needs a non-empty text")
    engine = Engine.from_stack(stack, registry=registry)
    if not args.raw:
        prompt = engine.target.format_prompt(prompt)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, seed=args.seed, stop=args.stop)
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
    headers = {"plugin": "PLUGIN", "distribution": "DISTRIBUTION", "version": "VERSION", "status": "STATUS"}
    widths = {k: max(len(headers[k]), *(len(str(r[k])) for r in rows)) if rows else len(headers[k])
              for k in headers}
    for row in [{**headers, "components": "COMPONENTS"}, *rows]:
        print("  ".join(f"{str(row[k]):<{widths[k]}}" for k in headers) + "  " + row["components"])
    return 0


def cmd_stacks(args: argparse.Namespace) -> int:
    from .registry import default_registry
    from .stacks import resolve_stack

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


def cmd_train_drafter(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from . import drafter_training as dt
    from .targets import load_target

    target = load_target(args.target)
    work = Path(args.work)
    started = time.time()
    if args.stage in ("collect", "all"):
        dt.collect(target, work, prompts=args.prompts, shard_size=args.shard_size, batch=args.batch,
                   new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                   worker=args.worker, workers=args.workers, split=args.split, slice_name=args.slice,
                   source=args.source)
    if args.stage in ("train", "all"):
        if not args.out:
            raise ConfigError("--out is required to train")
        provenance = {"command": "dynaspec " + " ".join(sys.argv[1:]), "target": args.target, "work": str(work)}
        dt.train(target, work, Path(args.out), epochs=args.epochs, steps=args.steps, lr=args.lr,
                 window=args.window,
                 batch_positions=args.batch_positions, unroll=args.unroll, max_shards=args.max_shards,
                 provenance=provenance)
    print(f"done in {time.time() - started:.0f} s", file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .evaluate import evaluate, format_table
    from .files import atomic_write

    if args.merge:
        from .evaluate import merge

        report = merge([json.loads(Path(f).read_text()) for f in args.merge])
    else:
        k, _, n = (args.part or "0/1").partition("/")
        report = evaluate(args.stacks, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                          overrides=_overrides(args), part=(int(k), int(n or 1)), split=args.split,
                          train_offset=args.train_offset, slice_name=args.slice,
                          temperature=args.temperature, seed=args.seed)
    print(format_table(report))
    if "cost" in report:
        from .cost_model import format_cost_table

        machine = report["machine"]
        print()
        print(format_cost_table(report["cost"], bandwidth=machine["read_bandwidth"],
                                weights=machine["weight_bytes"]))
    if args.json_out:
        atomic_write(Path(args.json_out), lambda p: Path(p).write_text(json.dumps(report, indent=2)))
    exact = all(f["exact"] is not False for per in report["stacks"].values() for f in per.values())
    if not exact:
        print("dynaspec: error: a greedy stack's output differs from the baseline's", file=sys.stderr)
    return 0 if exact else 1


def cmd_build_frequency(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .shortlisters.frequency import build_frequency_list

    path = build_frequency_list(args.target, args.source, Path(args.out), work=args.work,
                                limit=args.conversations, export=args.export_token_map,
                                command="dynaspec " + " ".join(sys.argv[1:]))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_build_clusters(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .shortlisters.clusters import save_clusters, spherical_kmeans
    from .targets import load_target

    target = load_target(args.target)
    assignment, centroids, log = spherical_kmeans(target.lm_head_weight, args.clusters,
                                                  iterations=args.iterations, seed=args.seed)
    path = save_clusters(Path(args.out), assignment, centroids, {
        "target": target.fingerprint(), "clusters": args.clusters, "seed": args.seed, "kmeans": log,
        "command": "dynaspec " + " ".join(sys.argv[1:])})
    print(f"wrote {path} (cluster sizes {log['min_size']}..{log['max_size']}, "
          f"{log['iterations']} iterations)", file=sys.stderr)
    return 0


def _train_shards(folders: list[str], max_shards: int | None) -> list:
    """Train-split shards of ``folders`` (first ``max_shards`` of each), ordered so that the last
    shard of the first folder comes last: the one held out for recall."""

    from .drafter_training import describe_shards, shard_paths

    per_folder = []
    for folder in folders:
        found = shard_paths(folder)[:max_shards]
        if not found:
            raise ConfigError(f"no shards in {folder}: collect them with `dynaspec train-drafter --stage collect`")
        per_folder.append(found)
    first = per_folder[0]
    shards = [*first[:-1], *[p for rest in per_folder[1:] for p in rest], first[-1]]
    describe_shards(shards)  # refuses shards of another split than train
    return shards


def cmd_train_router(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .shortlisters.clusters import load_clusters
    from .shortlisters.router_training import train_router
    from .targets import load_drafter, load_target, resolve_artifact

    target = load_target(args.target)
    fingerprint = target.fingerprint()
    clusters = load_clusters(resolve_artifact(args.clusters), fingerprint)
    drafter = load_drafter(args.drafter, target).float() if args.drafter else None
    shards = _train_shards(args.work, args.max_shards)
    core_ids = None
    if (args.core is None) != (args.frequency is None):
        raise ConfigError("--core and --frequency go together: the hybrid's always-on core is the top "
                          "--core tokens of the --frequency list")
    if args.core is not None:
        from .shortlisters.frequency import load_frequency

        if args.core < 1:
            raise ConfigError(f"--core {args.core} is invalid: must be at least 1")
        core_ids = load_frequency(resolve_artifact(args.frequency), fingerprint)[0][:args.core]
    stats = train_router(shards, target.embed, clusters["assignment"].long(), clusters["centroids"].shape[0],
                         target.hidden_size, drafter=drafter, out=Path(args.out), fingerprint=fingerprint,
                         width=args.width, epochs=args.epochs, lr=args.lr,
                         core_ids=core_ids, special_ids=target.special_token_ids,
                         provenance={"command": "dynaspec " + " ".join(sys.argv[1:]), "work": args.work,
                                     "clusters": args.clusters, "drafter": args.drafter,
                                     "frequency": args.frequency, "core": args.core})
    print(json.dumps(stats["held_out_recall"]), file=sys.stderr)
    return 0


def cmd_eval_shortlist(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .engine import Engine
    from .files import atomic_write
    from .shortlist_eval import evaluate_shortlisters, format_report, plot_report

    configs, target, drafter = {}, None, None
    # offline analysis of the shortlists: float32 throughout, whatever the stacks run in
    for engine in Engine.from_stacks(args.stacks, overrides={"dtype": "float32"}):
        target, drafter = engine.target, engine.drafter or drafter
        configs[engine.stack.name] = (engine.shortlister, engine.scheduler)
    from .drafter_training import shard_paths

    shards = [p for folder in args.work for p in shard_paths(folder)]
    if not shards:
        raise ConfigError(f"no shards in {' '.join(args.work)}: collect dev shards with "
                          "`dynaspec train-drafter --stage collect --split dev --work DIR`")
    report = evaluate_shortlisters(shards, target, drafter.float(), configs, depth=args.depth,
                                   max_positions=args.max_positions)
    print(format_report(report))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "shortlist_eval.json", lambda p: Path(p).write_text(json.dumps(report, indent=2)))
    plot_report(report, out / "recall_vs_size.png")
    print(f"wrote {out / 'shortlist_eval.json'} and {out / 'recall_vs_size.png'}", file=sys.stderr)
    return 0


def cmd_bench_head(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from .bench_head import bench_head, draft_step_breakdown, format_breakdown, format_table, plot
    from .files import atomic_write
    from .targets import load_target

    target = load_target(args.target)
    dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in args.dtypes]
    report = bench_head(target.lm_head_weight, args.backends, args.sizes, args.rows, dtypes,
                        repeats=args.repeats)
    print(format_table(report))
    if args.breakdown:
        from .bench import parse_questions

        prompts = [q.turns[0] for q in parse_questions(None)][: args.breakdown_prompts]
        report["draft_step_breakdown"] = draft_step_breakdown(
            args.breakdown, prompts, max_new_tokens=args.breakdown_tokens, overrides=_overrides(args))
        print()
        print(format_breakdown(report["draft_step_breakdown"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "bench_head.json", lambda p: Path(p).write_text(json.dumps(report, indent=2)))
    plot(report, out / "bench_head.png")
    print(f"wrote {out / 'bench_head.json'} and {out / 'bench_head.png'}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .bench import markdown, parse_questions, run, select

    questions = []
    for path in args.questions or [None]:
        questions += parse_questions(path)
    questions = select(questions, args.limit_per_category)
    results = run(args.stacks, questions, Path(args.out), max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, seed=args.seed, overrides=_overrides(args))
    print(markdown(results))
    if not results["exact"]:
        print("dynaspec: error: a greedy stack's output differs from the baseline's", file=sys.stderr)
        return 1
    return 0


def _add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0 = torch's default); 1 suits a shared machine")


def _add_placement(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="cpu, cuda or cuda:N for the target, the drafter and every tensor of the "
                        "engine (default: the stack's `device`, cpu for the built-in stacks)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                        help="the target's dtype (default: the stack's `dtype`; auto = bfloat16 where the "
                        "hardware computes it natively, else float32); the baseline it is compared with "
                        "always runs in the same dtype")


#: commands that read the ShareGPT data (the `data` extra), checked before any model loads
_NEEDS_DATA = {"eval", "train-drafter"}


def _ensure_folder(path: str, what: str) -> None:
    """Fail in one line, before any work, if the folder ``path`` could not be created or written;
    nothing is created here (a failed command leaves no empty folder behind)."""
    import os
    import tempfile
    from pathlib import Path

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


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail fast on outputs that cannot be written and on a missing data extra."""
    from pathlib import Path

    needs_data = ((args.command in _NEEDS_DATA and not getattr(args, "merge", None))
                  or (args.command == "build-frequency" and args.source == "raw"))
    if needs_data:
        from .data import require_dataset

        require_dataset()
    if getattr(args, "json_out", None):
        _ensure_folder(str(Path(args.json_out).expanduser().parent), "the folder of --json-out")
    out = getattr(args, "out", None)
    if isinstance(out, str):
        folder = Path(out).parent if out.endswith(".safetensors") else Path(out)
        _ensure_folder(str(folder), "--out")
    if args.command == "train-drafter":
        _ensure_folder(args.work, "--work")


class _Parser(argparse.ArgumentParser):
    """Bad arguments give one line (``dynaspec generate: error: ...``) and exit 2; ``-h`` has the rest."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dynaspec")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dynaspec", description="Speculative decoding with a context-aware dynamic draft vocabulary.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate a continuation of a prompt with a stack",
                         description="Generate a continuation with speculative decoding. Prints the "
                         "text, then one statistics line on stderr (or one JSON object with --json).")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the prompt text ('-' reads standard input; or use --prompt-file)")
    gen.add_argument("--prompt-file", metavar="PATH", default=None,
                     help="read the prompt from this UTF-8 file (long prompts exceed the shell's limit)")
    gen.add_argument("--raw", action="store_true",
                     help="pass the prompt to the target as it is; by default it is wrapped in the "
                     "target's prompt format (for the embedded Gemma: 'User: ...\nAssistant:', the "
                     "format the drafter was trained on)")
    gen.add_argument("--stack", default="default", help="stack name or TOML file (default: %(default)s)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=None, metavar="N",
                     help="tokens to generate, >= 1 (default: the stack's decode.max_new_tokens, 128 "
                     "for the built-in stacks)")
    gen.add_argument("--temperature", type=float, default=None, metavar="T",
                     help="0 = greedy, exactly the target's greedy output; above 0 samples with the "
                     "target's distribution (default: the stack's, 0 for the built-in stacks)")
    gen.add_argument("--top-p", type=float, default=None, metavar="P",
                     help="nucleus sampling mass, 0 < P <= 1 (default: the stack's, 1.0)")
    gen.add_argument("--seed", type=int, default=None, metavar="S", help="seed for sampling (default 0)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when the output contains TEXT (cut before it); repeatable")
    gen.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a stack field")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")
    _add_placement(gen)
    _add_threads(gen)
    gen.set_defaults(func=cmd_generate)

    plug = sub.add_parser("plugins", help="list plugins, their distributions and components")
    plug.add_argument("--json", action="store_true",
                      help="print a JSON list (plugin, distribution, version, status, components)")
    plug.set_defaults(func=cmd_plugins)

    tr = sub.add_parser(
        "train-drafter", help="collect target features on ShareGPT train and train the drafter",
        description="Stage 'collect' writes resumable shards (target greedy continuations of train "
        "prompts and the target's features) to --work; stage 'train' trains the EAGLE-style drafter "
        "on them (resumable from checkpoints in --work) and writes it atomically to --out.")
    tr.add_argument("--stage", choices=["collect", "train", "all"], default="all")
    tr.add_argument("--target", default="gemma3-270m")
    tr.add_argument("--work", required=True, help="folder for shards and checkpoints")
    tr.add_argument("--out", help="folder to write the drafter to")
    tr.add_argument("--prompts", type=int, default=2048, help="train prompts to collect")
    tr.add_argument("--shard-size", type=int, default=32)
    tr.add_argument("--batch", type=int, default=32, help="generation batch")
    tr.add_argument("--new-tokens", type=int, default=80, help="greedy tokens generated per prompt")
    tr.add_argument("--max-prompt-tokens", type=int, default=320)
    tr.add_argument("--split", choices=["train", "dev"], default="train",
                    help="collect on train (for training) or dev (for held-out evaluation only)")
    tr.add_argument("--source", choices=["generated", "raw"], default="generated",
                    help="generated: prompt + the target's greedy continuation; raw: prompt + the "
                    "conversation's own answer in one prefill pass (several times cheaper per position), "
                    "with the target's greedy next token stored as the teacher")
    tr.add_argument("--slice", choices=["english", "code", "non-english"], default=None,
                    help="collect only prompts of this slice (e.g. a held-out non-English set)")
    tr.add_argument("--worker", type=int, default=0, help="this process's index among --workers")
    tr.add_argument("--workers", type=int, default=1, help="collection processes sharing the shards")
    tr.add_argument("--epochs", type=int, default=2)
    tr.add_argument("--steps", type=int, default=None,
                    help="train this many steps instead of --epochs, re-reading the shard list every "
                    "epoch (a collection running beside it feeds later epochs)")
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--window", type=int, default=256)
    tr.add_argument("--batch-positions", type=int, default=2048)
    tr.add_argument("--unroll", type=int, default=2, help="draft steps trained per position")
    tr.add_argument("--max-shards", type=int, default=None, help="train on the first N shards only")
    _add_threads(tr)
    tr.set_defaults(func=cmd_train_drafter)

    ev = sub.add_parser(
        "eval", help="dev-protocol acceptance, exactness and speed of stacks against the baseline",
        description="The standard dev protocol: the first human turn of the first N ShareGPT dev "
        "conversations (cut to 1,500 characters), greedy, baseline and stacks interleaved prompt by "
        "prompt. Prints a per-slice table; exits 1 if any output differs from the baseline's.")
    ev.add_argument("--stacks", nargs="+", default=["default"], help="stack names or TOML files")
    ev.add_argument("--prompts", type=int, default=40)
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument("--set", action="append", metavar="FIELD=VALUE",
                    help="override a field of every evaluated stack (not the baseline)")
    ev.add_argument("--split", choices=["dev", "train"], default="dev",
                    help="dev (report figures) or train (tune settings: never tune on dev)")
    ev.add_argument("--slice", choices=["english", "code", "non-english"], default=None,
                    help="only prompts of this slice (the first --prompts of it)")
    ev.add_argument("--train-offset", type=int, default=10000, metavar="N",
                    help="with --split train, start at train prompt N (default %(default)s: beyond "
                    "what train-drafter collects by default, so the drafter never saw them)")
    ev.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default) decodes greedily and checks every stack's output against the "
                    "baseline's; above 0 samples (speed and acceptance only)")
    ev.add_argument("--seed", type=int, default=0,
                    help="with --temperature, prompt i samples with seed S + i in every stack (default 0)")
    ev.add_argument("--json-out", metavar="FILE", help="write the full report as JSON")
    ev.add_argument("--part", metavar="K/N", help="run only prompts K, K+N, ... (parallel processes)")
    ev.add_argument("--merge", nargs="+", metavar="JSON", help="merge the JSON reports of parts and print")
    _add_placement(ev)
    _add_threads(ev)
    ev.set_defaults(func=cmd_eval)

    bf = sub.add_parser(
        "build-frequency", help="count token frequencies for the static `frequency` shortlister",
        description="Rank the vocabulary by frequency: --source raw counts ShareGPT train text "
        "tokenized by the target (FR-Spec); --source generated counts the target's own greedy "
        "continuations collected by `train-drafter --stage collect` in --work (VocabTrim).")
    bf.add_argument("--target", default="gemma3-270m")
    bf.add_argument("--source", choices=["raw", "generated"], default="raw")
    bf.add_argument("--work", help="collection folder (for --source generated)")
    bf.add_argument("--conversations", type=int, default=None, help="count only the first N train conversations")
    bf.add_argument("--out", required=True, help="folder (or .safetensors file) to write")
    bf.add_argument("--export-token-map", type=int, nargs="*", default=[], metavar="SIZE",
                    help="also write freq_SIZE.pt token maps (SGLang --speculative-token-map)")
    _add_threads(bf)
    bf.set_defaults(func=cmd_build_frequency)

    bc = sub.add_parser("build-clusters", help="spherical k-means of the LM-head rows into M clusters",
                        description="Cluster the column-normalised LM-head rows (one per token) with "
                        "spherical k-means (k-means++ seeding, fixed seed, empty-cluster repair).")
    bc.add_argument("--target", default="gemma3-270m")
    bc.add_argument("--clusters", type=int, default=1024, metavar="M")
    bc.add_argument("--iterations", type=int, default=25)
    bc.add_argument("--seed", type=int, default=0)
    bc.add_argument("--out", required=True, help="folder (or .safetensors file) to write")
    _add_threads(bc)
    bc.set_defaults(func=cmd_build_clusters)

    rt = sub.add_parser("train-router", help="train the DynaSpec router on collected train shards",
                        description="Train r([E(x_t), H~_{t-1}]) -> cluster scores so that the target's "
                        "next token falls in the top clusters; the last shard is held out for recall.")
    rt.add_argument("--target", default="gemma3-270m")
    rt.add_argument("--work", required=True, nargs="+",
                    help="`train-drafter --stage collect` folders (train split); the last shard of the "
                    "first folder is held out to report recall")
    rt.add_argument("--clusters", required=True, help="cluster artifact (name or path)")
    rt.add_argument("--drafter", help="drafter (name or path) whose predicted features deeper steps see")
    rt.add_argument("--out", required=True)
    rt.add_argument("--width", type=int, default=1024)
    rt.add_argument("--epochs", type=int, default=3)
    rt.add_argument("--lr", type=float, default=2e-3)
    rt.add_argument("--max-shards", type=int, default=None)
    rt.add_argument("--core", type=int, default=None, metavar="N",
                    help="train for the `hybrid` shortlister: its top N --frequency tokens are always on, "
                    "so the router gets one more class ('in the core') and its clusters only have to "
                    "find the other tokens; use the router with that same frequency list and core")
    rt.add_argument("--frequency", default=None, help="frequency list (name or path) of the --core")
    _add_threads(rt)
    rt.set_defaults(func=cmd_train_router)

    es = sub.add_parser("eval-shortlist", help="offline shortlist recall per depth against size (dev)",
                        description="Recall of the target's next token in each stack's shortlist, per draft "
                        "depth and slice, on dev shards (collected with --split dev), and the accepted length "
                        "of greedy chain decoding replayed offline with the drafter's favourite inside each "
                        "shortlist; table, JSON and PNG.")
    es.add_argument("--stacks", nargs="+", required=True, help="stacks whose shortlister/scheduler to evaluate")
    es.add_argument("--work", required=True, nargs="+", help="dev shard folders")
    es.add_argument("--depth", type=int, default=6)
    es.add_argument("--max-positions", type=int, default=None)
    es.add_argument("--out", required=True, help="folder for shortlist_eval.json and recall_vs_size.png")
    _add_threads(es)
    es.set_defaults(func=cmd_eval_shortlist)

    bh = sub.add_parser("bench-head", help="draft-head time against shortlist size, per backend",
                        description="Time the shortlisted draft-head product for each backend (interleaved, "
                        "median of repeats) against the memory-bandwidth bound measured in the same run.")
    bh.add_argument("--target", default="gemma3-270m")
    bh.add_argument("--backends", nargs="+", default=["torch", "torch-blocked"])
    bh.add_argument("--sizes", type=int, nargs="+",
                    default=[1024, 4096, 8192, 16384, 26214, 32768, 65536, 131072, 262144])
    bh.add_argument("--rows", type=int, nargs="+", default=[1, 10], help="1 token and a tree-sized batch")
    bh.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    bh.add_argument("--repeats", type=int, default=7)
    bh.add_argument("--breakdown", nargs="*", metavar="STACK", default=[],
                    help="also time whole generations of these stacks (first = reference) and print ms "
                    "per draft step split into embed, draft core, router and head GEMM")
    bh.add_argument("--breakdown-prompts", type=int, default=4, metavar="N",
                    help="built-in bench prompts for --breakdown (default: %(default)s)")
    bh.add_argument("--breakdown-tokens", type=int, default=48, metavar="N")
    bh.add_argument("--set", action="append", metavar="FIELD=VALUE",
                    help="override a field of every --breakdown stack (e.g. backend=torch-blocked)")
    bh.add_argument("--out", required=True)
    _add_threads(bh)
    bh.set_defaults(func=cmd_bench_head)

    be = sub.add_parser("bench", help="compare stacks side by side on Spec-Bench-format questions",
                        description="Run baseline and stacks interleaved on Spec-Bench (question_id, category, "
                        "turns) or HumanEval (task_id, prompt) files, or on the built-in set; write answer "
                        "files, results.json, results.md and plots to --out. Rerunning with the same --out "
                        "skips finished answers. Exit 1 if a greedy stack differs from the baseline.")
    be.add_argument("--questions", nargs="+", help="question files (default: the built-in set)")
    be.add_argument("--stacks", nargs="+", default=["default"])
    be.add_argument("--max-new-tokens", type=int, default=64)
    be.add_argument("--limit-per-category", type=int, default=None, metavar="K")
    be.add_argument("--temperature", type=float, default=0.0)
    be.add_argument("--seed", type=int, default=0)
    be.add_argument("--set", action="append", metavar="FIELD=VALUE",
                    help="override a field of every benchmarked stack (not the baseline)")
    be.add_argument("--out", required=True)
    _add_placement(be)
    _add_threads(be)
    be.set_defaults(func=cmd_bench)

    stacks = sub.add_parser("stacks", help="list stacks, or show one resolved")
    stacks.add_argument("name", nargs="?", help="a stack name or TOML file to show in full")
    stacks.set_defaults(func=cmd_stacks)
    _complete_help(parser)
    return parser


#: help for options whose meaning is the same wherever they appear
_COMMON_HELP = {
    "--target": "target model: a built-in name (gemma3-270m, tiny-llama, tiny-gemma3) or a Hugging Face "
                "model folder",
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        _check_outputs(args)
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
