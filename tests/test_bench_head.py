"""`dynaspec bench-head`: the head timing table, the bandwidth bound and the draft-step breakdown."""

from __future__ import annotations

import json

import pytest
import torch

from dynaspec.cli import main
from dynaspec.evaluation import bench_head


def test_bench_head_times_every_backend_size_and_dtype():
    weight = torch.randn(3000, 64)
    report = bench_head.bench_head(weight, ["torch", "torch-blocked"], [100, 1000, 5000], [1, 4],
                                   [torch.float32, torch.bfloat16], repeats=2)
    rows = report["results"]
    assert len(rows) == 2 * 2 * 3 * 2
    assert {r["backend"] for r in rows} == {"torch", "torch-blocked"}
    assert {r["size"] for r in rows} == {100, 1000, 3000}  # clipped to the vocabulary
    assert report["bandwidth_bytes_per_s"] > 1e8 and report["copy_bandwidth_bytes_per_s"] > 1e8
    bound = {(r["backend"], r["dtype"], r["rows"], r["size"]): r["bound"] for r in rows}
    for r in rows:
        assert r["seconds"] > 0
    # the bound is what reading the shortlisted rows costs: ten times the rows, ten times the bound;
    # half the bytes per element, half the bound
    assert bound[("torch", "float32", 1, 1000)] == pytest.approx(10 * bound[("torch", "float32", 1, 100)])
    assert bound[("torch", "bfloat16", 4, 1000)] == pytest.approx(bound[("torch", "float32", 4, 1000)] / 2)
    table = bench_head.format_table(report)
    assert "| bfloat16 | 4 | 1,000 | torch-blocked |" in table


def test_draft_step_breakdown_splits_time_per_step(tiny_spec_stack):
    report = bench_head.draft_step_breakdown([str(tiny_spec_stack), "baseline"], ["hello there", "abc"],
                                             max_new_tokens=12)
    spec = report["spec"]
    assert spec["draft_steps"] > 0
    assert set(spec["ms_per_step"]) == set(bench_head.STEP_KEYS)
    # the parts are measured inside the generations: together they fit in their wall time
    assert 0 < spec["total_ms_per_step"] * spec["draft_steps"] / 1e3 < spec["wall_seconds"]
    assert spec["ratio_to_first"] == 1.0 and spec["mean_accepted_length"] >= 1.0
    assert report["baseline"]["draft_steps"] == 0  # plain decoding drafts nothing
    assert "| spec |" in bench_head.format_breakdown(report)


def test_bench_head_cli_writes_json_and_plot(tmp_path, tiny_spec_stack):
    code = main(["bench-head", "--target", "tiny-llama", "--sizes", "16", "64", "--rows", "1",
                 "--dtypes", "fp32", "--repeats", "1", "--breakdown", str(tiny_spec_stack),
                 "--breakdown-prompts", "1", "--breakdown-tokens", "8", "--out", str(tmp_path / "out")])
    assert code == 0
    report = json.loads((tmp_path / "out" / "bench_head.json").read_text())
    assert len(report["results"]) == 2 * 2  # two default backends, two sizes
    assert report["draft_step_breakdown"]["spec"]["draft_steps"] > 0
    assert (tmp_path / "out" / "bench_head.png").stat().st_size > 1000


def test_bench_head_times_a_random_head_of_a_given_shape(tmp_path):
    code = main(["bench-head", "--head-shape", "3000", "48", "--sizes", "100", "5000", "--rows", "1", "3",
                 "--dtypes", "bf16", "--repeats", "1", "--backends", "torch", "--out", str(tmp_path / "out")])
    assert code == 0
    report = json.loads((tmp_path / "out" / "bench_head.json").read_text())
    assert report["head_shape"] == [3000, 48] and report["device"] == "cpu"
    # sizes beyond the vocabulary are clipped to the whole head
    assert sorted({(r["rows"], r["size"]) for r in report["results"]}) == [(1, 100), (1, 3000), (3, 100), (3, 3000)]


def test_bench_head_refuses_bad_shapes_and_missing_devices(tmp_path, capsys):
    assert main(["bench-head", "--head-shape", "0", "48", "--out", str(tmp_path / "a")]) != 0
    assert "--head-shape needs two positive sizes" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench-head", "--head-shape", "100", "8", "--device", "cuda", "--out", str(tmp_path / "b")]) != 0
        assert "device 'cuda'" in capsys.readouterr().err
