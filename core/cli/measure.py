"""The commands that measure stacks: ``eval`` (the dev protocol), ``bench`` (Spec-Bench-format
questions), ``eval-shortlist`` and ``bench-head``. The work itself lives in :mod:`dynaspec.evaluation`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dynaspec.cli.common import command, overrides, positive_int, write_json

_DIFFERS = "dynaspec: error: a greedy stack's output differs from the baseline's"


def register(sub) -> None:
    ev = command(sub, cmd_eval, "eval", placement=True,
        help="dev-protocol acceptance, exactness and speed of stacks against the baseline")
    ev.add_argument("--stacks", nargs="+", default=["default"], help="stack names or TOML files")
    ev.add_argument("--prompts", type=positive_int, default=40)
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument("--set", action="append", metavar="FIELD=VALUE",
                    help="override a field of every evaluated stack (not the baseline)")
    ev.add_argument("--split", choices=["dev", "train"], default="dev",
                    help="dev (report figures) or train (tune settings: never tune on dev)")
    ev.add_argument("--slice", choices=["english", "code", "non-english"], default=None,
                    help="only prompts of this slice (the first --prompts of it)")
    ev.add_argument("--train-offset", type=int, default=None, metavar="N",
                    help="with --split train, start at train prompt N (default: 10000, "
                    "dynaspec.training.data.SELECTION_OFFSET: beyond what train-drafter collects by "
                    "default, and --turns later stops before these conversations, so the drafter "
                    "never saw them)")
    ev.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default) decodes greedily and checks every stack's output against the "
                    "baseline's; above 0 samples (speed and acceptance only)")
    ev.add_argument("--seed", type=int, default=0,
                    help="with --temperature, prompt i samples with seed S + i in every stack (default 0)")
    ev.add_argument("--json-out", metavar="FILE", help="write the full report as JSON")
    ev.add_argument("--part", metavar="K/N", help="run only prompts K, K+N, ... (parallel processes)")
    ev.add_argument("--merge", nargs="+", metavar="JSON", help="merge the JSON reports of parts and print")

    es = command(sub, cmd_eval_shortlist, "eval-shortlist",
        help="offline shortlist recall per depth against size (dev)")
    es.add_argument("--stacks", nargs="+", required=True, help="stacks whose shortlister/scheduler to evaluate")
    es.add_argument("--work", required=True, nargs="+", help="dev shard folders")
    es.add_argument("--depth", type=int, default=6)
    es.add_argument("--max-positions", type=int, default=None)
    es.add_argument("--out", required=True, help="folder for shortlist_eval.json and recall_vs_size.png")

    bh = command(sub, cmd_bench_head, "bench-head", target=True,
        help="draft-head time against shortlist size, per backend")
    bh.add_argument("--backends", nargs="+", default=["torch", "torch-blocked"])
    bh.add_argument("--sizes", type=int, nargs="+",
                    default=[1024, 4096, 8192, 16384, 26214, 32768, 65536, 131072, 262144])
    bh.add_argument("--rows", type=int, nargs="+", default=[1, 10], help="1 token and a tree-sized batch")
    bh.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    bh.add_argument("--repeats", type=int, default=7)
    bh.add_argument("--device", default="cpu", help="where the head is timed: cpu or cuda[:N] (default: %(default)s)")
    bh.add_argument("--head-shape", type=int, nargs=2, metavar=("VOCAB", "HIDDEN"),
                    help="time a random head of this shape instead of the target's (no model is loaded; "
                    "e.g. 262144 640 for Gemma 3's, 151936 896 for Qwen2.5-0.5B's)")
    bh.add_argument("--breakdown", nargs="*", metavar="STACK", default=[],
                    help="also time whole generations of these stacks (first = reference) and print ms "
                    "per draft step split into embed, draft core, router and head GEMM")
    bh.add_argument("--breakdown-prompts", type=int, default=4, metavar="N",
                    help="built-in bench prompts for --breakdown (default: %(default)s)")
    bh.add_argument("--breakdown-tokens", type=int, default=48, metavar="N")
    bh.add_argument("--set", action="append", metavar="FIELD=VALUE",
                    help="override a field of every --breakdown stack (e.g. backend=torch-blocked)")
    bh.add_argument("--out", required=True)

    be = command(sub, cmd_bench, "bench", placement=True,
        help="compare stacks side by side on Spec-Bench-format questions")
    be.add_argument("--questions", nargs="+", help="question files (default: the built-in set)")
    be.add_argument("--stacks", nargs="+", default=["default"])
    be.add_argument("--max-new-tokens", type=int, default=64)
    be.add_argument("--limit-per-category", type=int, default=None, metavar="K")
    be.add_argument("--temperature", type=float, default=0.0)
    be.add_argument("--seed", type=int, default=0)
    be.add_argument("--repeat", type=positive_int, default=1, metavar="N",
                    help="answer every question N times with every stack, interleaved, and keep the run of "
                    "median time (default 1): a short answer takes about a second, and one slow moment of a "
                    "shared machine moves its figure by a third")
    be.add_argument("--set", action="append", metavar="FIELD=VALUE",
                    help="override a field of every benchmarked stack (not the baseline)")
    be.add_argument("--out", required=True)


def _read_report(path: str) -> dict:
    """A JSON report named on the command line, or a clear error."""
    from dynaspec.errors import InputError

    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"no report at {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} is not a JSON report: {exc}") from None


def cmd_eval(args: argparse.Namespace) -> int:
    """The standard dev protocol: the first human turn of the first N ShareGPT dev conversations
    (cut to 1,500 characters), greedy, baseline and stacks interleaved prompt by prompt. Prints
    a per-slice table; exits 1 if any output differs from the baseline's."""
    from dynaspec.evaluation.cost_model import format_cost_table
    from dynaspec.evaluation.evaluate import evaluate, format_table, merge

    if args.merge:
        report = merge([_read_report(f) for f in args.merge])
    else:
        k, _, n = (args.part or "0/1").partition("/")
        report = evaluate(args.stacks, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                          overrides=overrides(args), part=(int(k), int(n or 1)), split=args.split,
                          train_offset=args.train_offset, slice_name=args.slice,
                          temperature=args.temperature, seed=args.seed)
    print(format_table(report))
    if "cost" in report:
        machine = report["machine"]
        print()
        print(format_cost_table(report["cost"], bandwidth=machine["read_bandwidth"],
                                weights=machine["weight_bytes"]))
    if args.json_out:
        write_json(Path(args.json_out), report)
    exact = all(f["exact"] is not False for per in report["stacks"].values() for f in per.values())
    if not exact:
        print(_DIFFERS, file=sys.stderr)
    return 0 if exact else 1


def cmd_eval_shortlist(args: argparse.Namespace) -> int:
    """Recall of the target's next token in each stack's shortlist, per draft depth and slice,
    on dev shards (collected with --split dev), and the accepted length of greedy chain decoding
    replayed offline with the drafter's favourite inside each shortlist; table, JSON and PNG."""
    from dynaspec.evaluation.shortlist import run

    run(args.stacks, args.work, Path(args.out), depth=args.depth, max_positions=args.max_positions)
    return 0


def cmd_bench_head(args: argparse.Namespace) -> int:
    """Time the shortlisted draft-head product for each backend (interleaved, median of repeats)
    against the memory-bandwidth bound measured in the same run."""
    from dynaspec.evaluation.bench_head import run

    run(args.target, Path(args.out), backends=args.backends, sizes=args.sizes, rows=args.rows,
        dtypes=args.dtypes, repeats=args.repeats, breakdown=args.breakdown,
        breakdown_prompts=args.breakdown_prompts, breakdown_tokens=args.breakdown_tokens,
        overrides=overrides(args), device=args.device, head_shape=args.head_shape)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run baseline and stacks interleaved on Spec-Bench (question_id, category, turns) or
    HumanEval (task_id, prompt) files, or on the built-in set; write answer files, results.json,
    results.md and plots to --out. Rerunning with the same --out skips finished answers. Exit 1
    if a greedy stack differs from the baseline."""
    from dynaspec.evaluation.bench import markdown, parse_questions, run, select

    questions = []
    for path in args.questions or [None]:
        questions += parse_questions(path)
    questions = select(questions, args.limit_per_category)
    results = run(args.stacks, questions, Path(args.out), max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, seed=args.seed, overrides=overrides(args), repeat=args.repeat)
    print(markdown(results))
    if not results["exact"]:
        print(_DIFFERS, file=sys.stderr)
        return 1
    return 0
