"""The one report helper of the studies: OUT/{stem}.md|json|png, tables, figures and the number format.

Every study ends the same way: its results go to ``OUT/{stem}.md`` (tables), ``OUT/{stem}.json`` (strict
JSON, everything) and ``OUT/{stem}.png`` (the figure), each written atomically, then a summary is printed
and the paths. A ``Report`` names the three pieces of a study (markdown, plot, console summary);
``md_table`` / ``rich_table`` lay out one set of cells for both media, and ``new_figure`` /
``finish_axes`` hold the plot boilerplate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from k2lab.fsutil import atomic_write_text

Results = dict[str, Any]


# ---- numbers and JSON ------------------------------------------------------------------------------------
def fmt(value: Any, spec: str = ".3f") -> str:
    """``value`` formatted, or an em dash for None / NaN / infinity."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return format(value, spec)


def strict_json(value: Any) -> Any:
    """NaN / infinity -> None, so the JSON written is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


def write_json(path: Path, value: Any) -> None:
    """``value`` as strict, indented JSON at ``path`` (atomically)."""
    atomic_write_text(path, json.dumps(strict_json(value), indent=2) + "\n")


# ---- the report ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Report:
    """A study's outputs: ``{stem}.md`` from ``markdown``, ``{stem}.png`` from ``plot``, ``summary`` printed."""

    stem: str
    markdown: Callable[[Results], str]
    plot: Callable[[Results, Path], Path]
    summary: Callable[[Results, Console], None]

    def write(self, results: Results, out: Path, console: Console) -> Results:
        """Write OUT/{stem}.md, .json and .png, print the summary and the paths; returns ``results``."""
        paths = [out / f"{self.stem}.{suffix}" for suffix in ("md", "json", "png")]
        atomic_write_text(paths[0], self.markdown(results))
        write_json(paths[1], results)
        self.plot(results, paths[2])
        self.summary(results, console)
        console.print("wrote " + ", ".join(map(str, paths)), soft_wrap=True)
        return results


def timing_note(results: Results, runs: int) -> str:
    """The report's last line: training time of the runs and wall time of the invocation."""
    s = results["settings"]
    cpu = results.get("training_cpu_seconds", math.nan)
    return (
        f"Training time of the {runs} runs: {results.get('training_seconds', math.nan) / 60:.1f} min "
        f"(torch threads per run: {s.get('threads', '?')}, parallel jobs: {s.get('jobs', 1)}; "
        "a reused run counts with its original time"
        + (f"; CPU time {cpu / 60:.1f} min" if math.isfinite(cpu) else "")
        + f"); wall time of this invocation {results.get('wall_seconds', math.nan) / 60:.1f} min."
    )


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a markdown table."""
    return [
        "| " + " | ".join(header) + " |",
        "|---|" + "---|" * (len(header) - 1),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def rich_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """The same cells as a rich table: first column left-aligned, the others right-aligned."""
    table = Table(title=title)
    for index, column in enumerate(header):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


# ---- figures ---------------------------------------------------------------------------------------------
def new_figure(figsize: tuple[float, float], layout: str | None = "constrained") -> Any:
    """A matplotlib ``Figure`` (100 dpi) on the Agg canvas, without pyplot's global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib (0.3 s) only to draw
    from matplotlib.figure import Figure  # lazy: matplotlib only to draw

    figure = Figure(figsize=figsize, dpi=100, layout=layout)
    FigureCanvasAgg(figure)
    return figure


def finish_axes(
    ax: Any,
    xlabel: str | None = None,
    ylabel: str | None = None,
    legend: bool = True,
    which: str = "major",
) -> None:
    """Axis labels, a small legend and a light grid."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if legend:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which=which)


def plot_val_curve(ax: Any, curve: list[dict[str, Any]], x: str = "step", **style: Any) -> None:
    """A validation curve (``[{x: …, "val_loss": …}]``) with markers."""
    ax.plot([p[x] for p in curve], [p["val_loss"] for p in curve], marker="o", **style)
