"""Whole-process start times: ``dynaspec generate`` of one token, per stack, beside llama.cpp's.

Each run starts every system once, one after the other (so a busy neighbour weighs on all alike):
``dynaspec generate --stack S --threads T --max-new-tokens 1 "Hi"`` per stack and, with
``--llama-bin``, ``llama-completion`` of one token on the target's own GGUF. A process's time is
from its start to its exit, the first token included. Prints median, min and max per system.

    python scripts/start_time.py --stacks default,gemma --runs 5 --threads 1 \\
        --llama-bin LLAMA --target qwen2.5-coder-0.5b --gguf-dir GGUFS --json-out start.json

The first run of a stack on a machine converts its target and saves its image
(:mod:`dynaspec.runtime.image`); run once before timing warm starts, or pass ``--first`` to time
that first start too (it removes the stacks' saved images first, in the cache in use).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def dynaspec_start(stack: str, threads: int, env: dict | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(["dynaspec", "generate", "--stack", stack, "--threads", str(threads), "--max-new-tokens", "1",
                    "Hi"], check=True, capture_output=True, stdin=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def llama_start(binary: str, gguf: Path, threads: int) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_cpp_compare import run_llama

    return run_llama(binary, gguf, "Hi", 1, threads)["process_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", default="default", help="comma-separated stacks")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--llama-bin", help="llama.cpp's llama-completion (see scripts/llama_cpp_compare.py --build)")
    parser.add_argument("--target", default="qwen2.5-coder-0.5b", help="whose GGUF llama.cpp loads")
    parser.add_argument("--gguf-dir", type=Path, default=Path("ggufs"))
    parser.add_argument("--first", action="store_true",
                        help="also time each stack's first start (its saved image removed before)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    stacks = [s for s in args.stacks.split(",") if s]
    if args.runs < 1 or not stacks:
        parser.error("--runs must be at least 1, and --stacks name at least one stack")
    report: dict = {"threads": args.threads, "runs": args.runs, "seconds": {}, "first": {}}
    if args.first:
        from dynaspec.runtime.cache import cache_root, remove_folder

        for stack in stacks:
            for folder in (cache_root() / "images").glob("*"):
                remove_folder(folder)
            report["first"][stack] = dynaspec_start(stack, args.threads)
            print(f"first start, {stack}: {report['first'][stack]:.2f} s (image saved)", flush=True)
    gguf = None
    if args.llama_bin:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from llama_cpp_compare import gguf_file

        gguf = gguf_file(args.target, args.gguf_dir)
    for _ in range(args.runs):
        for stack in stacks:
            report["seconds"].setdefault(f"dynaspec generate --stack {stack}", []).append(
                dynaspec_start(stack, args.threads))
        if gguf is not None:
            report["seconds"].setdefault(f"llama.cpp ({gguf.name})", []).append(
                llama_start(args.llama_bin, gguf, args.threads))
    print(f"| system, {args.runs} runs, {args.threads} thread(s) | median s | min | max |\n|---|---|---|---|")
    for name, times in report["seconds"].items():
        print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
