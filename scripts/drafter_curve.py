"""The drafter's data curve: dev accepted length (a chain of 5, full vocabulary) against the training
positions of drafters trained with one recipe on nested shard sets. Writes a markdown table, a PNG
and the log-linear fit that extrapolates it.

    python scripts/drafter_curve.py --stack eagle-chain --out docs/drafter-curve \\
        --point 3 docs/results/curve/drafter-curve-3.json docs/results/curve/dev-curve-3-{0,1}.json \\
        --point ...

Each ``--point`` is a label, the drafter's ``drafter.json`` (its ``positions_at_end``) and the
``dynaspec eval --json-out`` reports of its dev run (the parts of one run are merged). ``--extra``
points (drafters of another recipe) are tabled and plotted apart, and left out of the fit.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from dynaspec.evaluation.evaluate import merge
from dynaspec.evaluation.plots import figure, markdown_table

SLICES = ("overall", "english", "code", "non-english")


def _point(label: str, drafter_json: str, reports: list[str], stack: str) -> dict:
    training = json.loads(Path(drafter_json).read_text())["training"]
    report = merge([json.loads(Path(r).read_text()) for r in reports])
    figures = report["stacks"][stack]
    if not all(f["exact"] for f in figures.values()):
        raise SystemExit(f"{label}: an output differs from the baseline's")
    return {"label": label, "positions": int(training["positions_at_end"]),
            **{s: figures[s]["mean_accepted_length"] for s in SLICES if s in figures}}


def fit(points: list[dict]) -> tuple[float, float]:
    """Least squares of accepted length = a + b * ln(positions): (a, b)."""
    b, a = np.polyfit([math.log(p["positions"]) for p in points], [p["overall"] for p in points], 1)
    return float(a), float(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", nargs="+", action="append", required=True,
                        metavar="LABEL DRAFTER_JSON REPORT", help="a label, a drafter.json and its dev reports")
    parser.add_argument("--extra", nargs="+", action="append", default=[], metavar="LABEL DRAFTER_JSON REPORT",
                        help="a drafter of another recipe: tabled and plotted apart, not fitted")
    parser.add_argument("--stack", default="eagle-chain", help="the evaluated stack's name in the reports")
    parser.add_argument("--extra-stack", action="append", default=[],
                        help="the stack's name in the --extra reports (default: --stack): once for all of "
                        "them, or once per --extra, in order")
    parser.add_argument("--goal", type=float, default=2.8, help="the accepted length to extrapolate to")
    parser.add_argument("--out", required=True, help="OUT.md and OUT.png are written")
    args = parser.parse_args()
    if any(len(p) < 3 for p in args.point + args.extra):
        parser.error("each --point needs a label, a drafter.json and at least one report")
    points = sorted((_point(p[0], p[1], p[2:], args.stack) for p in args.point), key=lambda p: p["positions"])
    if len(points) < 2:
        parser.error("a curve needs at least two points")
    extra_stacks = args.extra_stack or [args.stack]
    if len(extra_stacks) == 1:
        extra_stacks = extra_stacks * len(args.extra)
    if len(extra_stacks) != len(args.extra):
        parser.error(f"{len(args.extra_stack)} --extra-stack for {len(args.extra)} --extra: give one, or one each")
    extras = [_point(p[0], p[1], p[2:], stack) for p, stack in zip(args.extra, extra_stacks)]
    a, b = fit(points)
    need = math.exp((args.goal - a) / b) if b > 0 else float("inf")
    rows = [[p["label"], f"{p['positions']:,}", *(f"{p[s]:.3f}" if s in p else "-" for s in SLICES)]
            for p in points]
    rows += [[f"{p['label']} (another recipe, not fitted)", f"{p['positions']:,}",
              *(f"{p[s]:.3f}" if s in p else "-" for s in SLICES)] for p in extras]
    text = markdown_table(["drafter", "train positions", *[f"accepted length: {s}" for s in SLICES]], rows)
    text += (f"\n\nLog-linear fit over the {len(points)} points: accepted length = {a:.3f} + {b:.3f} ln(positions), "
             f"that is +{b * math.log(2):.3f} per doubling of the data; {args.goal} at about "
             f"{float(f'{need:.2g}'):,.0f} positions (two significant figures).\n")
    out = Path(args.out)
    out.with_suffix(".md").write_text(text)
    with figure(out.with_suffix(".png"), xlabel="training positions", ylabel="dev accepted length (chain of 5)",
                xlog=True, grid=True, size=(7, 4.5)) as ax:
        xs = [p["positions"] for p in points]
        ax.plot(xs, [p["overall"] for p in points], "o-", label="dev, overall")
        if all("code" in p for p in points):
            ax.plot(xs, [p["code"] for p in points], "s--", alpha=0.6, label="dev, code")
        span = [min(xs), max(max(xs), min(need, 50 * max(xs)))]
        ax.plot(span, [a + b * math.log(x) for x in span], ":", color="gray", label="log-linear fit")
        ax.axhline(args.goal, color="red", alpha=0.4, label=f"goal {args.goal}")
        for p in extras:
            ax.plot([p["positions"]], [p["overall"]], "*", markersize=12, label=f"{p['label']}, overall")
        for p in points:  # the other recipes are named in the legend
            ax.annotate(p["label"], (p["positions"], p["overall"]), textcoords="offset points", xytext=(4, -10),
                        fontsize=7)
        ax.legend(loc="lower right", fontsize=7)
    print(text)


if __name__ == "__main__":
    main()
