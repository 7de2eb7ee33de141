"""Vision-injection ablation (K2.5): early 10:90, mid 20:80 and late 50:50 fusion on the same budget.

K2.5 reports that, "under a fixed total visual-plus-text token budget, early 10:90 fusion beats late 50:50
fusion". Each arm is one ``run_training`` call of the same recipe (same seed, so the same initial weights,
text data, lr, schedule, batch and evaluation batches) except ``vision.start`` and ``vision.ratio``:

| arm   | vision from (``start``) | visual rows after (``ratio``) | visual share of the run    |
|-------|-------------------------|-------------------------------|----------------------------|
| early | 0 % of the steps        | 10 %                          | (1 − 0.0) · 0.1 = 10 %     |
| mid   | 50 %                    | 20 %                          | (1 − 0.5) · 0.2 = 10 %     |
| late  | 80 %                    | 50 %                          | (1 − 0.8) · 0.5 = 10 %     |

With S steps, G micro-batches per step and B rows per micro-batch, micro-batch m gets
n(m) = ⌊(m − s₀G + 1)·B·r⌋ − ⌊(m − s₀G)·B·r⌋ visual rows from s₀ = ⌊start·S⌋ on
(``k2lab.vision.mixture.vision_rows_at``), so an arm spends V = Σₘ n(m) = ⌊(S − s₀)·G·B·r⌋ rows on vision
and its visual fraction of the budget is V / (S·G·B). Every row holds T token slots, so this is also the
visual share of the token budget. ``visual_rows`` counts V exactly; the ablation refuses a recipe whose
arms differ by even one row, or spend none: with S a multiple of 10 every arm spends exactly S·G·B / 10 rows
at any batch size, and the arms start vision at exactly 0 %, 50 % and 80 % of the steps. The reports give
the start step actually used and its fraction s₀ / S (with 15 steps the mid arm starts at step 7, 47 %).

Reported per arm: the final text validation loss (the same held-out text batches for every arm), its
curve over the steps, and the held-out visual scores per task kind (mean K2.5 visual reward in [0, 1],
``k2lab.vision.evaluate``). K2.5 reports vision knowledge / reasoning / OCR and text knowledge /
reasoning / code benchmarks instead; this is the small-scale analogue, whatever direction it shows.

Outputs, for an output directory ``DIR``: ``DIR/vision_injection.json`` (everything, with the curves),
``DIR/vision_injection.md`` (the table) and ``DIR/vision_injection.png`` (text validation loss per arm
with each arm's injection step; visual scores per task kind and arm). Runs live in ``DIR/runs/{arm}`` and
are reused when the command is repeated (``k2lab.ablations.common``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator
from rich.console import Console

from k2lab.ablations.common import (
    AblationSettings,
    PlannedRun,
    StudyRun,
    ordered_subset,
    recipe_settings,
    run_times,
    with_updates,
)
from k2lab.ablations.report import (
    Report,
    finish_axes,
    fmt,
    md_table,
    new_figure,
    plot_val_curve,
    rich_table,
    timing_note,
)
from k2lab.fsutil import save_figure_atomically
from k2lab.train.config import TrainConfig
from k2lab.train.metrics import read_metrics
from k2lab.vision.mixture import vision_rows_at

ARMS: dict[str, tuple[float, float]] = {"early": (0.0, 0.1), "mid": (0.5, 0.2), "late": (0.8, 0.5)}
LABELS = {"early": "early 10:90", "mid": "mid 20:80", "late": "late 50:50"}
COLORS = {"early": "tab:green", "mid": "tab:blue", "late": "tab:red"}
BUDGET_HEADER = [
    "arm",
    "vision from step",
    "visual rows (share)",
    "text val loss",
    "visual mean",
    "gray-image mean",
    "train min",
]
SHORT = {"counting": "count", "grounding_box": "box", "grounding_point": "point", "segmentation": "seg"}

# k25-mini (k2-mini decoder, 2-layer 128-wide MoonViT-3D) on the embedded corpus: 3 arms × 200 steps ×
# 8×256 tokens and 60 held-out visual samples each, in 3 one-thread worker processes: ~2.8 s per step
# and arm on 2 CPU cores shared with another busy process (10-step arms measured at 2.8 s/step), so
# ~12 min in all.
DEFAULT_RECIPE: dict[str, Any] = {
    "preset": "k25-mini",
    "steps": 200,
    "batch_size": 8,
    "seq_len": 256,
    "eval_batches": 4,
    "sample_tokens": 0,
    "schedule": {"kind": "wsd", "warmup_steps": 20, "decay_fraction": 0.2, "min_lr_ratio": 0.1},
    "vision": {"eval_samples": 60},
}


class VisionInjectionConfig(AblationSettings):
    """What to run: a base recipe (everything but ``vision.start`` / ``vision.ratio``) and the arms.

    ``jobs`` defaults to one worker process per arm, each with ``threads`` torch threads (default: this
    process's threads divided among the jobs, at least one).
    """

    BASE = DEFAULT_RECIPE
    EVAL_POINTS = 10  # validation every steps // 10: the left panel draws the curves
    WHAT = "vision-injection ablation setting"

    arms: list[str] = Field(
        default_factory=lambda: list(ARMS), description="Arms compared (of early, mid, late)"
    )
    jobs: int | None = Field(
        default=None, gt=0, description="Arms trained at once, in worker processes (unset: one per arm)"
    )
    out: str = Field(default="runs/vision-injection", description="Output directory")

    @field_validator("arms")
    @classmethod
    def _known_arms(cls, names: list[str]) -> list[str]:
        return ordered_subset(names, tuple(ARMS), "arms")

    @model_validator(mode="after")
    def _same_visual_budget(self) -> VisionInjectionConfig:
        if self.base.vision is None:
            raise ValueError(f"preset {self.base.preset!r} is not a vision-language preset (e.g. k25-mini)")
        rows = {arm: visual_rows(arm_config(self, arm)) for arm in self.arms}
        if len(set(rows.values())) > 1 or 0 in rows.values():
            raise ValueError(
                f"the arms would spend {'no' if 0 in rows.values() else 'different'} visual budgets "
                f"(visual rows {rows} with {self.base.steps} steps); take steps a multiple of 10: every arm then "
                "spends exactly a tenth of its rows on vision, at any batch size"
            )
        if self.jobs is None:
            self.jobs = len(self.arms)
        return self


def arm_config(ablation: VisionInjectionConfig, arm: str) -> TrainConfig:
    """The base recipe with this arm's ``vision.start`` and ``vision.ratio`` and its own run directory."""
    start, ratio = ARMS[arm]
    vision = ablation.base.vision.model_copy(update={"start": start, "ratio": ratio})
    return with_updates(ablation.base, vision=vision, out=str(Path(ablation.out) / "runs" / arm))


def total_rows(config: TrainConfig) -> int:
    """S·G·B: the rows of every micro-batch of the run."""
    return config.steps * config.grad_accum * config.batch_size


def visual_rows(config: TrainConfig) -> int:
    """V = Σₘ n(m) over the S·G micro-batches, n(m) = ``vision_rows_at(m, B, r, s₀·G)``, s₀ = ⌊start·S⌋
    (what ``MixedBatches`` puts in the run, counted exactly)."""
    vision, accum = config.vision, config.grad_accum
    first = vision.start_step(config.steps) * accum
    return sum(
        vision_rows_at(micro, config.batch_size, vision.ratio, first) for micro in range(config.steps * accum)
    )


# ---- running ---------------------------------------------------------------------------------------------
def summarize_arm(arm: str, config: TrainConfig, summary: dict, reused: bool) -> dict[str, Any]:
    """One arm's budget, losses and visual scores (the val-loss curve from its ``metrics.jsonl``)."""
    records = read_metrics(config.out)
    val = [{"step": r["step"], "val_loss": float(r["val_loss"])} for r in records if "val_loss" in r]
    rows = visual_rows(config)
    return {
        "arm": arm,
        "start": config.vision.start,
        "ratio": config.vision.ratio,
        "start_step": config.vision.start_step(config.steps),
        "start_fraction": config.vision.start_step(config.steps) / config.steps,
        "visual_rows": rows,
        "total_rows": total_rows(config),
        "visual_fraction": rows / total_rows(config),
        "val_loss": float(summary.get("val_loss", math.nan)),
        "val_curve": val,
        "unigram_baseline": summary.get("unigram_baseline", math.nan),
        "visual_scores": summary.get("visual_scores", {}),
        "visual_scores_blind": summary.get("visual_scores_blind", {}),
        "run_dir": str(config.out),
        **run_times(summary, reused),
    }


def run_vision_injection(ablation: VisionInjectionConfig, console: Console | None = None) -> dict[str, Any]:
    """Train every arm (or reuse it), write DIR/vision_injection.{json,md,png}; returns the results."""
    study = StudyRun(ablation, console or Console())
    configs = {arm: arm_config(ablation, arm) for arm in ablation.arms}
    print_budget(configs, study.console)
    plan = [
        PlannedRun(config, f"{LABELS[arm]}: vision from step {config.vision.start_step(config.steps)} → "
                   f"{config.out}", arm)
        for arm, config in configs.items()
    ]  # fmt: skip

    def describe(index: int, summary: dict) -> str:
        scores = summary.get("visual_scores", {})
        return (
            f"{LABELS[ablation.arms[index]]}: text val loss {summary.get('val_loss', math.nan):.4f}, "
            f"visual mean {fmt(scores.get('mean'))}"
        )

    outcomes = study.train(plan, describe)
    runs = [
        summarize_arm(arm, config, summary, reused)
        for (arm, config), (summary, reused) in zip(configs.items(), outcomes, strict=True)
    ]
    return study.finish(analyse(ablation, runs), runs, REPORT)


def analyse(ablation: VisionInjectionConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Settings, the arms, the task kinds scored and the budget check."""
    base = ablation.base
    rows = [run["visual_rows"] for run in runs]
    kinds = sorted({kind for run in runs for kind in run["visual_scores"] if kind != "mean"})
    return {
        "settings": {
            **recipe_settings(base),
            "optimizer": base.optimizer.name,
            "lr": base.optimizer.lr,
            "tasks": list(base.vision.tasks),
            "eval_samples": base.vision.eval_samples,
            "eval_max_new_tokens": base.vision.eval_max_new_tokens,
            "vision_overrides": base.vision.vision_overrides,
            "arms": ablation.arms,
        },
        "runs": runs,
        "kinds": kinds,
        "same_visual_rows": len(set(rows)) == 1,
    }


# ---- outputs ---------------------------------------------------------------------------------------------
def print_budget(configs: dict[str, TrainConfig], console: Console) -> None:
    """One line per arm: where vision starts and the visual rows V of S·G·B (its share of the budget)."""
    for arm, config in configs.items():
        rows, total = visual_rows(config), total_rows(config)
        console.print(
            f"{LABELS[arm]}: vision from step {config.vision.start_step(config.steps)} of {config.steps} at "
            f"ratio {config.vision.ratio:g} → {rows} of {total} rows visual ({rows / total:.2%} of the "
            "budget)"
        )


def tables(results: dict[str, Any], short: bool = False) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of the two comparison tables, one row per arm: the budget and the text loss,
    then the visual scores per task kind (``short``: abbreviated kind names, for an 80-column console)."""
    runs, kinds = results["runs"], results["kinds"]
    budget = [
        [
            LABELS[run["arm"]],
            f"{run['start_step']} ({run['start_fraction']:.0%})",
            f"{run['visual_rows']} ({run['visual_fraction']:.2%})",
            fmt(run["val_loss"], ".4f"),
            fmt(run["visual_scores"].get("mean")),
            fmt(run["visual_scores_blind"].get("mean")),
            fmt(run["seconds"] / 60, ".1f"),
        ]
        for run in runs
    ]
    scores = [
        [LABELS[run["arm"]], *(fmt(run["visual_scores"].get(kind)) for kind in [*kinds, "mean"])]
        for run in runs
    ]
    names = [SHORT.get(kind, kind) if short else kind for kind in kinds]
    header = (
        ["arm", "from step", "visual rows", "text val", "vis. mean", "gray", "min"]
        if short
        else BUDGET_HEADER
    )
    rows = f"of {runs[0]['total_rows']:,} rows" if runs else ""
    return [
        (f"budget ({rows}) and text loss", header, budget),
        ("held-out visual scores (mean reward)", ["arm", *names, "mean"], scores),
    ]


def markdown_report(results: dict[str, Any]) -> str:
    """The tables of ``vision_injection.md``."""
    s = results["settings"]
    budget = "equal" if results["same_visual_rows"] else "NOT equal (the arms are not comparable)"
    lines = [
        f"# Vision-injection ablation: {s['preset']}, {s['steps']} steps × {s['tokens_per_step']:,} tokens "
        f"({s['tokens']:,} visual-plus-text tokens per arm)",
        "",
        f"Same initial weights (seed {s['seed']}), text data, lr ({s['optimizer']} {s['lr']:g}, schedule "
        f"{s['schedule']['kind']}), batch and evaluation batches for every arm; visual budgets {budget}. "
        f"Data: {s['data']}; precision {s['precision']}. Text val loss: the final loss on held-out text. "
        f"Visual scores: mean K2.5 visual reward in [0, 1] on {s['eval_samples']} held-out samples of "
        f"{', '.join(s['tasks'])} (greedy, ≤ {s['eval_max_new_tokens']} new tokens); gray-image mean: the "
        "same prompts with uniform gray images, what the language prior alone scores.",
    ]
    for title, header, rows in tables(results):
        lines += ["", f"## {title[0].upper()}{title[1:]}", "", *md_table(header, rows)]
    lines += ["", timing_note(results, len(results["runs"])), ""]
    return "\n".join(lines)


def plot_vision_injection(results: dict[str, Any], target: Path) -> Path:
    """``vision_injection.png``: text val loss vs step (injection steps dashed); visual scores per kind."""
    s, runs = results["settings"], results["runs"]
    figure = new_figure((14, 5.5))
    figure.suptitle(
        f"Vision injection at a fixed visual-plus-text budget: {s['preset']}, {s['tokens']:,} tokens per arm",
        fontsize=13,
    )
    loss_ax, score_ax = figure.subplots(1, 2, width_ratios=[1, 1.3])
    for run in runs:
        color = COLORS[run["arm"]]
        label = f"{LABELS[run['arm']]} (final {fmt(run['val_loss'], '.3f')})"
        plot_val_curve(loss_ax, run["val_curve"], color=color, label=label)
        loss_ax.axvline(run["start_step"], color=color, linestyle="--", linewidth=1)
    loss_ax.set_title("text validation loss (dashed: the arm's injection step)", fontsize=10)
    finish_axes(loss_ax, "step", "nats/token")
    _score_bars(score_ax, results)
    finish_axes(score_ax)
    return save_figure_atomically(figure, target)


def _score_bars(ax: Any, results: dict[str, Any]) -> None:
    """Grouped bars: one group per task kind (and the mean), one bar per arm."""
    kinds, runs = [*results["kinds"], "mean"], results["runs"]
    width = 0.8 / max(len(runs), 1)
    for index, run in enumerate(runs):
        offsets = [k + (index - (len(runs) - 1) / 2) * width for k in range(len(kinds))]
        values = [run["visual_scores"].get(kind, math.nan) for kind in kinds]
        bars = ax.bar(offsets, values, width, color=COLORS[run["arm"]], label=LABELS[run["arm"]])
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    ax.set_xticks(range(len(kinds)), kinds, rotation=20, fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("mean visual reward (held-out)")
    ax.set_title(
        f"visual scores per task ({results['settings']['eval_samples']} held-out samples)", fontsize=10
    )


def print_summary(results: dict[str, Any], console: Console) -> None:
    """The comparison as two rich tables, and a warning when the visual budgets differ."""
    s = results["settings"]
    for index, (title, header, rows) in enumerate(tables(results, short=True)):
        heading = f"vision injection, {s['preset']}, {s['steps']} steps: {title}" if index == 0 else title
        console.print(rich_table(heading, header, rows))
    if not results["same_visual_rows"]:
        console.print("[yellow]warning:[/] the arms' visual budgets differ")


REPORT = Report("vision_injection", markdown_report, plot_vision_injection, print_summary)
