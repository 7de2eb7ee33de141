"""One-page PNG dashboard of a training run, drawn from ``RUN_DIR/metrics.jsonl``.

Panels (2 x 3): loss and val_loss (and ``mtp_loss``, the multi-token-prediction loss, when logged);
learning rate; per-layer max attention logit with the QK-Clip threshold τ; heads clipped by QK-Clip per
step; expert-load heatmap of the latest step (load / mean load per layer, 1 = balanced); expert-load
imbalance (max / mean) per layer over steps. A panel whose keys are absent says "no data". Uses
matplotlib's Agg canvas directly (no pyplot, no global backend switch), so it is safe to call from a
training loop or a headless machine.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from k2lab.errors import K2LabError
from k2lab.fsutil import save_figure_atomically
from k2lab.train.metrics import METRICS_FILE, read_metrics

DASHBOARD_FILE = "dashboard.png"
_LAYER_KEY = re.compile(r"^(?P<prefix>.+)/layer(?P<index>\d+)$")
_MAX_LEGEND = 8


def plot_dashboard(
    run_dir: str | os.PathLike[str], tau: float | None = None, output: str | os.PathLike[str] | None = None
) -> Path:
    """Draw the dashboard of ``run_dir`` to ``output`` (default ``RUN_DIR/dashboard.png``); returns the path.

    ``tau`` is the QK-Clip threshold drawn on the max-logit panel (omitted when ``None``). The PNG is
    written to a temporary file and renamed into place, so a viewer never sees a half-written image.
    Raises ``K2LabError`` if the run has no metrics.jsonl.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib (0.3 s) only to draw
    from matplotlib.figure import Figure  # lazy: matplotlib only to draw

    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise K2LabError(f"{run_dir} has no {METRICS_FILE}: nothing to plot")
    records = read_metrics(run_dir)
    target = Path(output) if output is not None else run_dir / DASHBOARD_FILE

    figure = Figure(figsize=(14, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 3)
    last = records[-1] if records else {}
    title = f"{run_dir.resolve().name}: step {last.get('step', '-')}"
    if isinstance(last.get("loss"), int | float):
        title += f", loss {last['loss']:.4f}"
    figure.suptitle(title, fontsize=14)

    _plot_loss(axes[0, 0], records)
    _plot_lr(axes[0, 1], records)
    _plot_max_logits(axes[0, 2], records, tau)
    _plot_clipping(axes[1, 0], records)
    _plot_load_heatmap(figure, axes[1, 1], records)
    _plot_imbalance(axes[1, 2], records)

    return save_figure_atomically(figure, target)


# ---- data helpers ---------------------------------------------------------------------------------------
def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of a scalar metric, over the records that have it."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def _layer_keys(records: list[dict[str, Any]], prefix: str) -> list[tuple[int, str]]:
    """``(layer, key)`` for every ``{prefix}/layer{i}`` key in the records, by layer index."""
    found: dict[int, str] = {}
    for record in records:
        for key in record:
            match = _LAYER_KEY.match(key)
            if match and match.group("prefix") == prefix:
                found[int(match.group("index"))] = key
    return sorted(found.items())


def _no_data(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", fontsize=14, color="gray", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _layer_colors(count: int) -> list[Any]:
    from matplotlib import colormaps  # lazy: matplotlib only to draw

    colormap = colormaps["viridis"]
    return [colormap(i / max(count - 1, 1)) for i in range(count)]


def _layer_legend(ax: Any, layers: list[int]) -> None:
    """A legend for a few layers; for many, the colour key goes into the x label."""
    if len(layers) <= _MAX_LEGEND:
        ax.legend(fontsize=8, loc="best")
        ax.set_xlabel("step")
    else:
        ax.set_xlabel(f"step   (colour: layer {layers[0]} dark → layer {layers[-1]} light)")


# ---- panels ---------------------------------------------------------------------------------------------
def _plot_loss(ax: Any, records: list[dict[str, Any]]) -> None:
    train = _series(records, "loss")
    val = _series(records, "val_loss")
    if not train[0] and not val[0]:
        _no_data(ax, "Loss")
        return
    if train[0]:
        ax.plot(*train, label="train loss", color="tab:blue", linewidth=1)
    if val[0]:
        ax.plot(*val, label="val loss", color="tab:orange", marker="o", markersize=4, linewidth=1.5)
    mtp = _series(records, "mtp_loss")
    if mtp[0]:
        ax.plot(*mtp, label="MTP loss (mean over depths)", color="tab:green", linewidth=1, alpha=0.8)
    ax.set_title("Loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)


def _plot_lr(ax: Any, records: list[dict[str, Any]]) -> None:
    steps, values = _series(records, "lr")
    if not steps:
        _no_data(ax, "Learning rate")
        return
    ax.plot(steps, values, color="tab:green")
    ax.set_title("Learning rate")
    ax.set_xlabel("step")
    ax.set_ylabel("lr")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.grid(alpha=0.3)


def _plot_max_logits(ax: Any, records: list[dict[str, Any]], tau: float | None) -> None:
    title = "Max attention logit per layer" + (f" (τ = {tau:g})" if tau is not None else "")
    layers = _layer_keys(records, "max_logit")
    if not layers and not _series(records, "max_logit")[0]:
        _no_data(ax, title)
        return
    if layers:
        for color, (layer, key) in zip(_layer_colors(len(layers)), layers, strict=True):
            ax.plot(*_series(records, key), color=color, linewidth=1, label=f"layer {layer}")
        _layer_legend(ax, [layer for layer, _ in layers])
    else:
        ax.plot(*_series(records, "max_logit"), color="tab:purple", linewidth=1, label="all layers")
        ax.legend(fontsize=8)
        ax.set_xlabel("step")
    if tau is not None:
        ax.axhline(tau, color="tab:red", linestyle="--", linewidth=1.5)
        ax.text(1.0, tau, " τ", color="tab:red", va="center", ha="left", transform=ax.get_yaxis_transform())
        bottom, top = ax.get_ylim()
        ax.set_ylim(bottom, max(top, tau + 0.08 * (tau - bottom)))
    ax.set_title(title)
    ax.set_ylabel("max over heads of q·k")
    ax.grid(alpha=0.3)


def _plot_clipping(ax: Any, records: list[dict[str, Any]]) -> None:
    steps, values = _series(records, "qk_clipped_heads")
    if not steps:
        _no_data(ax, "QK-Clip events")
        return
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False) if b > a]
    ax.bar(steps, values, width=min(gaps) if gaps else 1.0, color="tab:red", label="heads clipped")
    ax.set_title(f"QK-Clip events ({sum(v > 0 for v in values)} steps with clipping)")
    ax.set_xlabel("step")
    ax.set_ylabel("heads clipped this step")
    ax.grid(alpha=0.3, axis="y")
    ever_steps, ever = _series(records, "qk_clip_ever_frac")
    if ever_steps:
        twin = ax.twinx()
        twin.plot(ever_steps, [100 * v for v in ever], color="black", linewidth=1, label="ever clipped (%)")
        twin.set_ylabel("heads ever clipped (%)")
        twin.set_ylim(bottom=0)
        handles = ax.get_legend_handles_labels()
        twin_handles = twin.get_legend_handles_labels()
        ax.legend(handles[0] + twin_handles[0], handles[1] + twin_handles[1], fontsize=8, loc="upper left")


def _loads_at(record: dict[str, Any], layers: list[tuple[int, str]]) -> list[tuple[int, list[float]]]:
    return [
        (layer, record[key]) for layer, key in layers if isinstance(record.get(key), list) and record[key]
    ]


def _plot_load_heatmap(figure: Any, ax: Any, records: list[dict[str, Any]]) -> None:
    layers = _layer_keys(records, "expert_load")
    latest = next(((r["step"], rows) for r in reversed(records) if (rows := _loads_at(r, layers))), None)
    if latest is None:
        _no_data(ax, "Expert load (latest step)")
        return
    step, rows = latest
    width = max(len(loads) for _, loads in rows)
    matrix = np.full((len(rows), width), np.nan)
    for row, (_, loads) in enumerate(rows):
        values = np.asarray(loads, dtype=float)
        mean = values.mean()
        matrix[row, : len(values)] = values / mean if mean > 0 else values
    high = max(2.0, float(np.nanmax(matrix)) if np.isfinite(matrix).any() else 2.0)
    image = ax.imshow(
        matrix, aspect="auto", cmap="RdBu_r", norm=_centered_norm(high), interpolation="nearest"
    )
    ax.set_title(f"Expert load / layer mean at step {step} (1 = balanced)")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    every = -(-len(rows) // 16)
    ax.set_yticks(range(0, len(rows), every), [str(layer) for layer, _ in rows[::every]])
    if width <= 32:
        ax.set_xticks(range(width))
        ax.tick_params(axis="x", labelsize=7)
    figure.colorbar(image, ax=ax, label="load / mean")


def _centered_norm(high: float) -> Any:
    from matplotlib.colors import TwoSlopeNorm  # lazy: matplotlib only to draw

    return TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=max(high, 1.0 + 1e-6))


def _imbalance_series(records: list[dict[str, Any]], layer: int, load_key: str | None) -> tuple[list, list]:
    """max/mean load per step: the logged ``expert_imbalance/layer{i}``, else computed from the loads."""
    steps, values = _series(records, f"expert_imbalance/layer{layer}")
    if steps or load_key is None:
        return steps, values
    for record in records:
        loads = record.get(load_key)
        if isinstance(loads, list) and loads:
            mean = sum(loads) / len(loads)
            if mean > 0:
                steps.append(record["step"])
                values.append(max(loads) / mean)
    return steps, values


def _plot_imbalance(ax: Any, records: list[dict[str, Any]]) -> None:
    title = "Expert load imbalance (max / mean)"
    loads = dict(_layer_keys(records, "expert_load"))
    logged = dict(_layer_keys(records, "expert_imbalance"))
    layers = sorted(set(loads) | set(logged))
    curves = [(layer, _imbalance_series(records, layer, loads.get(layer))) for layer in layers]
    curves = [(layer, series) for layer, series in curves if series[0]]
    if not curves:
        _no_data(ax, title)
        return
    for color, (layer, series) in zip(_layer_colors(len(curves)), curves, strict=True):
        ax.plot(*series, color=color, linewidth=1, label=f"layer {layer}")
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    _layer_legend(ax, [layer for layer, _ in curves])
    ax.set_title(title)
    ax.set_ylabel("max load / mean load")
    ax.set_ylim(bottom=0.9)
    ax.grid(alpha=0.3)
