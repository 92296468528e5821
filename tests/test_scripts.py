"""The reproduction scripts in scripts/: the drafter curve's table, fit and PNG from eval reports."""

from __future__ import annotations

import json
import math
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
