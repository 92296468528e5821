"""The one plotting helper of the evaluation commands: a figure with labelled axes, written
atomically as PNG (matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def figure(path: str | Path, *, xlabel: str, ylabel: str, size: tuple[float, float] = (6, 4),
           xlog: bool = False, ylog: bool = False, title: str | None = None, legend: bool = False,
           grid: bool = False, dpi: int = 120) -> Iterator:
    """``with figure(path, xlabel=..., ylabel=...) as ax:`` draw on ``ax``; on leaving the block the
    axes are labelled and the figure is written to ``path`` (a PNG), replacing it atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dynaspec.runtime.files import atomic_write

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if xlog:
            ax.set_xscale("log")
        if ylog:
            ax.set_yscale("log")
        if title:
            ax.set_title(title)
        if grid:
            ax.grid(True, alpha=0.3)
        if legend:
            ax.legend(fontsize=7)
        fig.tight_layout()
        atomic_write(Path(path), lambda p: fig.savefig(p, dpi=dpi, format="png"))
    finally:
        plt.close(fig)


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A markdown table: the header row, the rule, then one line per row (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
