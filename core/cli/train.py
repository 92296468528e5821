"""The commands that build artifacts on the train split: ``train-drafter``, ``build-frequency``,
``build-clusters`` and ``train-router``. The work itself lives in :mod:`dynaspec.training`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dynaspec.cli.common import command, command_line, non_negative_int, positive_int
from dynaspec.errors import ConfigError
from dynaspec.runtime.config import WEIGHTS_CHOICES

#: the stages of `dynaspec prepare` (dynaspec.training.prepare.STAGES, without importing it)
PREPARE_STAGES = ("collect", "drafter", "frequency", "corpus", "clusters", "router", "stack")


#: how much data and time a good drafter takes, as measured (docs/drafter-curve.md; docs/history.md,
#: "The drafter's data curve")
PREPARE_EPILOG = """\
How much data and time a good drafter takes (measured on 2 cores of an AMD EPYC, one thread per job;
mean accepted length of a chain of 5 over the full vocabulary, the target's own token included):
  Gemma 3 270M   about +0.5 per doubling of the train positions: 1.68 at 70k positions, 2.50 at
                 195k, 2.74 at 301k; with fused layers 2.97 at 301k, 3.12 at 425k, 3.36 at 587k
                 (40 dev prompts; docs/drafter-curve.md)
  Qwen2.5-Coder  offline on 64 dev prompts (scripts/drafter_offline.py), each drafter trained on from
                 the one before with fused layers 3 and 12 and --loss-on answer: 1.69 at 247k positions
                 (41 shards of 32 prompts), 1.80 at 422k (72), 1.84 at 602k (105); about +0.1 per
                 doubling; 300 more steps on 33 shards of new prompts
                 (--first-prompt 3360), with or without 16 raw shards, left it at 1.78-1.80. It
                 memorises what it trains on (2.28 on 32 of its own train prompts, first position
                 73% against 49% on new ones). 1,000 steps on 137 shards of new prompts (1.06M
                 positions) took it from 1.79 to 1.88 on dev shards of its w8a8 weights; 250 more
                 steps with --unroll 4 to 1.92 (the shipped drafter: 1.29x in the engine on dev,
                 against 1.18x for the 1.79 drafter in the same run). On 64 train prompts it never
                 trained on (1.92 there), 400 more steps on 196 shards gave 1.96 and 1,000 more on
                 207 shards (1.56M positions, 84 minutes) 1.94: more steps on text of this kind
                 stopped paying. The drafter read its token input at a tenth of its features' size
                 (Qwen's embeddings: RMS 0.017; its hidden state: 6.4); with --embed-norm, 600 steps
                 on those shards and 116 shards of sampled continuations (2.4M positions, 52 minutes)
                 gave 2.03 (1.99 on dev), against 1.94 for the same steps without it. 800 more
                 steps with --init on 175 shards of new prompts (--first-prompt 11000, 1.33M
                 positions, 38 minutes on a Xeon with AMX) took it from 1.88 to 2.05 on 64 train
                 prompts neither had seen (its router and clusters prepared again beside it).
                 1,000 more steps with --more-data on 531 shards (175 of first turns, 356 of
                 later turns; 3.38M positions, 89 minutes over two runs beside other jobs) took it
                 from 2.05 to 2.15 on the same 64 prompts, and the engine's accepted length from
                 2.14 to 2.17 on 48 train prompts (1.74x against 1.71x; router and clusters
                 prepared beside it): the shipped drafter. 600 more steps on 256 shards of later
                 turns (1.45M positions, about 100 of them repeating its own; 47 minutes) left
                 the engine's accepted length where it was (2.145 against 2.150 on 48 train
                 prompts): more of the text kinds it has seen no longer moves it.
Collection is the long part. The target's own continuations (--source generated) are generated for
a shard's prompts together, one token each per pass of the target through its lean forward, on the
weights its default stack uses (--weights auto): about 80 answer positions a second on one core for
Qwen2.5-Coder-0.5B with w8a8 weights (50 s a shard of 32 prompts at --new-tokens 192; Hugging Face
generate, the path of targets without the lean forward, gave 15-17). --source raw (the
conversations' own answers, one prefill) gives about 70 and a worse drafter. Training computes in
bfloat16 where the CPU does natively (--precision auto): 600 steps of 2,048 positions took 31
minutes on two processes in float32; 1,000 steps took 32 minutes in bfloat16. Both resume where they stopped: run the collection in the
background early (--stage collect), and the drafter stage beside it (it re-reads the shards every
epoch). The corpus stage counts the target's greedy answers in seconds (Qwen2.5-Coder: 93 shards,
about 383,000 answer tokens, 143,524 n-grams, 3 s, a 3.5 MB table); rerun it with --redo corpus as
the collection grows.
"""


def _precision_and_weights(parser) -> None:
    """The options ``prepare`` and ``train-drafter`` share for how the target and the drafter compute."""
    parser.add_argument("--precision", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="the drafter's training products: bfloat16 (autocast; float32 weights, optimiser and "
                        "losses), float32, or auto (the default): bfloat16 where the CPU computes it natively (a step "
                        "1.6 times as fast as float32 on one Zen 4 core)")
    parser.add_argument("--weights", choices=list(WEIGHTS_CHOICES), default="auto",
                        help="the weights the target computes from: auto (the default) is what its default stacks "
                        "compute from (int8 weights and 8-bit activations for the embedded default), so the drafter "
                        "learns the continuations and features it will meet; collection generates several "
                        "sequences per pass of the target where it can")


_EMBED_NORM_HELP = ("an RMS norm on the token embedding before the drafter's fc, as EAGLE-3 has (for a target whose "
                    "embeddings are small beside its hidden state, as Qwen2.5's are); with --init, a drafter without "
                    "one gets it at gains that keep what it computes")


def register(sub) -> None:
    pr = command(sub, cmd_prepare, "prepare", help="build every artifact of a DynaSpec stack for a new target",
                 epilog=PREPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    pr.add_argument("--target", required=True,
                    help="a registered target name or a Hugging Face model folder (its chat template, if "
                    "any, is its prompt format)")
    pr.add_argument("--out", required=True, help="folder for the artifacts, prepare.json and stack.toml")
    pr.add_argument("--drafter", default=None,
                    help="use this drafter (built-in name or folder) instead of training one")
    pr.add_argument("--stage", nargs="+", default=[], metavar="STAGE", choices=list(PREPARE_STAGES),
                    help="run only these stages (default: all, skipping those already done)")
    pr.add_argument("--redo", nargs="+", default=[], metavar="STAGE", choices=list(PREPARE_STAGES),
                    help="run these stages again even if done (collect resumes and extends)")
    pr.add_argument("--prompts", type=positive_int, default=2048,
                    help="train prompts to collect (how much data a good drafter takes: see the end of this "
                    "help)")
    pr.add_argument("--first-prompt", type=non_negative_int, default=0, metavar="N",
                    help="collect the --prompts train prompts after the first N (new data for a drafter given "
                    "to --init that was trained on the first N; default 0)")
    pr.add_argument("--turns", choices=["first", "later"], default="first",
                    help="first: each train conversation's first human turn (16,588 of them: the dev "
                    "protocol's kind of prompt); later: the second and later human turns (25,349), each "
                    "standing alone as a prompt: new text once the first turns are all collected, "
                    "non-English above all (default: first)")
    pr.add_argument("--source", choices=["raw", "generated"], default="generated",
                    help="generated: prompt + the target's own greedy continuation (what it will draft "
                    "against: the better drafter); raw: prompt + the conversation's own answer in one "
                    "prefill (several times cheaper per position, a worse drafter)")
    pr.add_argument("--new-tokens", type=positive_int, default=None,
                    help="tokens generated (generated; default 96) or answer tokens kept (raw; default 256) "
                    "per prompt")
    pr.add_argument("--steps", type=positive_int, default=1000, help="drafter optimiser steps")
    pr.add_argument("--batch-positions", type=positive_int, default=2048)
    pr.add_argument("--unroll", type=positive_int, default=2,
                    help="draft steps trained per position, each after the first fed the drafter's own predicted "
                    "features (default 2; 4 trains deeper positions better at 1.6 times the cost of a step)")
    pr.add_argument("--drafter-width", type=positive_int, default=None,
                    help="width of the drafter's MLP (default: the target's intermediate size; narrower is "
                    "a smaller artifact and a cheaper draft step)")
    pr.add_argument("--feature-layers", nargs="+", default=["auto"], metavar="LAYER",
                    help="EAGLE-3-style fused features: target layers whose inputs the drafter reads "
                    "beside the final hidden state; 'auto' (the default): a low and a middle one, layers "
                    "L//8 and L//2 of L; 'none': the final hidden state alone")
    pr.add_argument("--embed-norm", action="store_true",
                    help=_EMBED_NORM_HELP)
    pr.add_argument("--init", metavar="DRAFTER", default=None,
                    help="start the drafter stage from this drafter (a built-in name or a folder) instead of "
                    "random weights: more training on more data; its feature layers are kept, and its width unless "
                    "--drafter-width widens it (the new units start silent)")
    pr.add_argument("--loss-on", choices=["answer", "all"], default="answer",
                    help="answer: the drafter learns at the positions whose next token is the target's own "
                    "continuation (what it drafts; the prompt is context); all: at the prompts' too")
    pr.add_argument("--more-data", nargs="+", default=[], metavar="FOLDER",
                    help="other prepare folders of the same target (their --out) whose collections the drafter, "
                    "frequency, corpus and router stages read beside this folder's own: collections of first and later "
                    "turns, or of several runs or machines, trained on together (this folder may then collect "
                    "nothing itself)")
    pr.add_argument("--sampled", type=non_negative_int, default=0, metavar="N",
                    help="also collect N sampled continuations of the same prompts (at --temperature, seeds 0 "
                    "to N-1, in OUT/work-sampled-SEED) and train the drafter on them beside the greedy ones: "
                    "more of the text the target writes without new prompts (default 0)")
    pr.add_argument("--temperature", type=float, default=0.7,
                    help="the temperature of --sampled continuations (default 0.7)")
    pr.add_argument("--clusters", type=positive_int, default=None, metavar="M",
                    help="vocabulary clusters (default: the vocabulary / 16, at most 1024)")
    pr.add_argument("--router-epochs", type=positive_int, default=3, help="passes over the router's examples")
    pr.add_argument("--router-width", type=positive_int, default=1024, help="hidden width of the router's MLP")
    pr.add_argument("--shard-size", type=positive_int, default=64)
    pr.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="the target's dtype while preparing: auto is bfloat16 where the CPU computes it "
                    "natively (its prefills run 2-3x faster there), else float32")
    _precision_and_weights(pr)

    tr = command(sub, cmd_train_drafter, "train-drafter", target=True,
        help="collect target features on ShareGPT train and train the drafter")
    tr.add_argument("--stage", choices=["collect", "train", "all"], default="all")
    tr.add_argument("--work", required=True, nargs="+",
                    help="folder for shards and checkpoints; the train stage may read several (the "
                    "checkpoints go in the first), the collect stage writes one")
    tr.add_argument("--out", help="folder to write the drafter to")
    tr.add_argument("--prompts", type=int, default=2048, help="train prompts to collect")
    tr.add_argument("--first-prompt", type=non_negative_int, default=0, metavar="N",
                    help="collect the --prompts prompts after the first N of the split (default 0); a "
                    "folder holds one such range")
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
    tr.add_argument("--turns", choices=["first", "later"], default="first",
                    help="first: each train conversation's first human turn (the dev protocol's kind of "
                    "prompt); later: its second and later human turns, each standing alone as a prompt "
                    "(more text of every slice, non-English above all; train split only, and never the "
                    "conversations that 'dynaspec eval --split train' chooses settings on)")
    tr.add_argument("--temperature", type=float, default=0.0,
                    help="with --source generated: sample the continuations at this temperature instead of "
                    "greedy (0), storing the target's greedy next token as the teacher; more text from the "
                    "same prompts, one folder per --seed")
    tr.add_argument("--seed", type=int, default=0, help="seed of sampled continuations (with --temperature)")
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
    tr.add_argument("--feature-layers", type=int, nargs="+", default=None, metavar="LAYER",
                    help="EAGLE-3-style fused features: the target layers whose inputs the drafter reads "
                    "beside the final hidden state (say 2 9: a low and a middle layer); kept per shard "
                    "in layers-A-B/ beside the shards, written by the collection when given to it too (else "
                    "computed once by training, a second pass of the target over the shards)")
    tr.add_argument("--drafter-width", type=positive_int, default=None,
                    help="width of the drafter's MLP (default: the target's intermediate size)")
    tr.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="the target's dtype for collection and fused features: auto is bfloat16 where the "
                    "CPU computes it natively (2-3x faster prefills there), else float32")
    _precision_and_weights(tr)
    tr.add_argument("--embed-norm", action="store_true",
                    help=_EMBED_NORM_HELP)
    tr.add_argument("--init", metavar="DRAFTER", default=None,
                    help="start from this drafter's weights (a folder, or a built-in name such as "
                    "gemma3-270m) instead of random ones: more training on more data; its architecture "
                    "is kept, and its own training record is kept in the new drafter's")
    tr.add_argument("--loss-on", choices=["answer", "all"], default="answer",
                    help="answer: learn at the positions whose next token is the target's own continuation "
                    "(what it drafts at inference; the prompt is context); all: at the prompts' positions "
                    "too (default: answer)")

    bf = command(sub, cmd_build_frequency, "build-frequency", target=True,
        help="count token frequencies for the static `frequency` shortlister")
    bf.add_argument("--source", choices=["raw", "generated"], default="raw")
    bf.add_argument("--work", help="collection folder (for --source generated)")
    bf.add_argument("--conversations", type=int, default=None, help="count only the first N train conversations")
    bf.add_argument("--out", required=True, help="folder (or .safetensors file) to write")
    bf.add_argument("--export-token-map", type=int, nargs="*", default=[], metavar="SIZE",
                    help="also write freq_SIZE.pt token maps (SGLang --speculative-token-map)")

    bo = command(sub, cmd_build_corpus, "build-corpus", target=True,
        help="count the `corpus` drafter's table: what the target wrote after each n-gram of its own answers")
    bo.add_argument("--work", required=True, nargs="+",
                    help="collection folders of train prompts with the target's greedy continuations (`prepare` "
                    "or `train-drafter --stage collect`, --source generated); sampled and raw shards are skipped")
    bo.add_argument("--out", required=True, help="folder (or .safetensors file) to write")
    bo.add_argument("--sizes", type=positive_int, nargs="+", default=[2, 3, 4], metavar="N",
                    help="n-gram lengths counted (default 2 3 4; the longest that the table holds decides)")
    bo.add_argument("--min-count", type=positive_int, default=2, metavar="K",
                    help="keep the n-grams seen at least K times (default 2: the drafter's default min_count; "
                    "a larger K makes a smaller file)")

    bc = command(sub, cmd_build_clusters, "build-clusters", target=True,
        help="spherical k-means of the LM-head rows into M clusters")
    bc.add_argument("--clusters", type=int, default=1024, metavar="M")
    bc.add_argument("--iterations", type=int, default=25)
    bc.add_argument("--seed", type=int, default=0)
    bc.add_argument("--out", required=True, help="folder (or .safetensors file) to write")

    rt = command(sub, cmd_train_router, "train-router", target=True,
        help="train the DynaSpec router on collected train shards")
    rt.add_argument("--work", required=True, nargs="+",
                    help="`train-drafter --stage collect` folders (train split); the last shard of the "
                    "first folder is held out to report recall")
    rt.add_argument("--clusters", required=True, help="cluster artifact (name or path)")
    rt.add_argument("--drafter", help="drafter (name or path) whose predicted features deeper steps see")
    rt.add_argument("--out", required=True)
    rt.add_argument("--width", type=int, default=1024)
    rt.add_argument("--epochs", type=int, default=3)
    rt.add_argument("--lr", type=float, default=2e-3)
    rt.add_argument("--batch", type=positive_int, default=1024, help="examples per optimisation step")
    rt.add_argument("--max-shards", type=int, default=None)
    rt.add_argument("--core", type=int, default=None, metavar="N",
                    help="train for the `hybrid` shortlister: its top N --frequency tokens are always on, "
                    "so the router gets one more class ('in the core') and its clusters only have to "
                    "find the other tokens; use the router with that same frequency list and core")
    rt.add_argument("--frequency", default=None, help="frequency list (name or path) of the --core")


def _feature_layers(values: list[str]) -> tuple[int, ...] | str:
    """``--feature-layers`` of prepare: ``auto``, ``none`` or layer numbers."""
    if values in (["auto"], ["none"]):
        return "auto" if values == ["auto"] else ()
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise ConfigError(f"--feature-layers {' '.join(values)}: give layer numbers, 'auto' or 'none'") from None


def cmd_prepare(args: argparse.Namespace) -> int:
    """Build everything a DynaSpec stack needs for a new target, resumably, in stages: collect train
    features in the target's prompt format, train the drafter (unless --drafter is given), count the
    frequency list and the corpus of its answers, cluster the vocabulary, train the router, and write OUT/stack.toml and the
    manifest OUT/prepare.json (artifacts, fingerprints, data, command and wall time per stage). Rerun
    the same command to resume; `--stack OUT/stack.toml` then works."""
    from dynaspec.training.prepare import PrepareBudget, prepare

    budget = PrepareBudget(prompts=args.prompts, first_prompt=args.first_prompt, turns=args.turns, source=args.source, shard_size=args.shard_size,
                           new_tokens=args.new_tokens, steps=args.steps, batch_positions=args.batch_positions,
                           unroll=args.unroll,
                           drafter_width=args.drafter_width, feature_layers=_feature_layers(args.feature_layers),
                           clusters=args.clusters,
                           router_epochs=args.router_epochs,
                           router_width=args.router_width, dtype=args.dtype, loss_on=args.loss_on,
                           weights=args.weights, precision=args.precision, sampled=args.sampled,
                           temperature=args.temperature, embed_norm=args.embed_norm)
    if args.sampled and not args.temperature > 0:
        raise ConfigError(f"--temperature {args.temperature}: sampled continuations need a temperature above 0")
    if args.sampled and args.source != "generated":
        raise ConfigError("--sampled continues the prompts: it needs --source generated")
    if args.init and args.drafter:
        raise ConfigError("--init starts a drafter's training and --drafter uses one untrained: give one of them")
    manifest = prepare(args.target, Path(args.out), budget=budget, drafter=args.drafter, redo=tuple(args.redo),
                       only=tuple(args.stage), command=command_line(), init=args.init,
                       more_data=tuple(args.more_data))
    for name, stage in manifest["stages"].items():
        print(f"{name:<10} {stage['seconds']:>8.1f} s  {', '.join(stage['outputs'])}", file=sys.stderr)
    print(f"use it: dynaspec generate --stack {Path(args.out) / 'stack.toml'} \"...\"", file=sys.stderr)
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    """Stage 'collect' writes resumable shards (target greedy continuations of train prompts and
    the target's features) to --work; stage 'train' trains the EAGLE-style drafter on them
    (resumable from checkpoints in --work) and writes it atomically to --out."""
    from dynaspec.runtime.targets import load_target
    from dynaspec.training import drafter as dt
    from dynaspec.training.collect import collect, sampling_kind, set_up_target

    if args.stage in ("collect", "all") and len(args.work) > 1:
        raise ConfigError("--stage collect writes one --work folder; give one")
    if args.stage in ("collect", "all") and args.turns == "later" and args.split != "train":
        raise ConfigError("--turns later collects on the train split only")
    if args.stage in ("collect", "all"):
        sampling_kind(args.temperature, args.source)  # refused before the target loads
    from dynaspec.runtime.numerics import resolve_dtype

    target = load_target(args.target)
    target.to(dtype=resolve_dtype(args.dtype, target.device))
    set_up_target(target, args.weights)
    work = Path(args.work[0])
    started = time.time()
    if args.stage in ("collect", "all"):
        collect(target, work, prompts=args.prompts, shard_size=args.shard_size, batch=args.batch,
                   new_tokens=args.new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                   worker=args.worker, workers=args.workers, split=args.split, slice_name=args.slice,
                   source=args.source, turns=args.turns, temperature=args.temperature, seed=args.seed,
                   feature_layers=args.feature_layers, first_prompt=args.first_prompt)
    if args.stage in ("train", "all"):
        if not args.out:
            raise ConfigError("--out is required to train")
        provenance = {"command": command_line(), "target": args.target, "work": [Path(w).name for w in args.work]}
        init = None
        if args.init:
            from dynaspec.runtime.targets import load_drafter

            init = load_drafter(args.init, target)
            if "training" not in init.meta:
                raise ConfigError(f"--init {args.init}: not a drafter that dynaspec trained (no training record)")
            provenance["init"] = {"drafter": Path(args.init).name, "training": init.meta.get("training")}
        dt.train(target, [Path(w) for w in args.work], Path(args.out), epochs=args.epochs, steps=args.steps, lr=args.lr,
                 window=args.window, batch_positions=args.batch_positions, unroll=args.unroll,
                 max_shards=args.max_shards, provenance=provenance, intermediate_size=args.drafter_width,
                 feature_layers=args.feature_layers, init=init, loss_on=args.loss_on, precision=args.precision,
                 embed_norm=args.embed_norm)
    print(f"done in {time.time() - started:.0f} s", file=sys.stderr)
    return 0


def cmd_build_frequency(args: argparse.Namespace) -> int:
    """Rank the vocabulary by frequency: --source raw counts ShareGPT train text tokenized by
    the target (FR-Spec); --source generated counts the target's own greedy continuations
    collected by `train-drafter --stage collect` in --work (VocabTrim)."""
    from dynaspec.training.vocabulary import build_frequency_list

    path = build_frequency_list(args.target, args.source, Path(args.out), work=args.work,
                                limit=args.conversations, export=args.export_token_map,
                                command=command_line())
    print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_build_corpus(args: argparse.Namespace) -> int:
    """Count, over the target's own greedy answers to train prompts (collected shards), the token
    it wrote most often after each n-gram, how often, and how often the n-gram occurred: the
    table the `corpus` drafter proposes from (retrieval drafting, with no model)."""
    from dynaspec.training.vocabulary import build_corpus

    path, counts = build_corpus(args.target, args.work, Path(args.out), sizes=tuple(args.sizes),
                                min_count=args.min_count, command=command_line())
    print(f"wrote {path}: {counts['entries']:,} n-grams from {counts['shards']} shards", file=sys.stderr)
    return 0


def cmd_build_clusters(args: argparse.Namespace) -> int:
    """Cluster the column-normalised LM-head rows (one per token) with spherical k-means
    (k-means++ seeding, fixed seed, empty-cluster repair)."""
    from dynaspec.training.vocabulary import build_clusters

    path, log = build_clusters(args.target, Path(args.out), clusters=args.clusters,
                               iterations=args.iterations, seed=args.seed, command=command_line())
    print(f"wrote {path} (cluster sizes {log['min_size']}..{log['max_size']}, "
          f"{log['iterations']} iterations)", file=sys.stderr)
    return 0


def cmd_train_router(args: argparse.Namespace) -> int:
    """Train r([E(x_t), H~_{t-1}]) -> cluster scores so that the target's next token falls in
    the top clusters; the last shard is held out for recall."""
    from dynaspec.training.router import build_router

    stats = build_router(args.target, args.work, args.clusters, Path(args.out), drafter_ref=args.drafter,
                         width=args.width, epochs=args.epochs, lr=args.lr, max_shards=args.max_shards,
                         core=args.core, frequency_ref=args.frequency, batch=args.batch, command=command_line())
    print(json.dumps(stats["held_out_recall"]), file=sys.stderr)
    return 0
