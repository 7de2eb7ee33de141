"""Router-bias ablation: no bias rule, the DeepSeek-V3 sign rule and K3 Quantile Balancing on the same tokens.

Every run is one ``run_training`` call with the same recipe except ``balance.bias_rule`` (and, for the sign
rule, ``balance.gamma``) and its run directory, so initial weights (seed), data order, lr, schedule,
batch and evaluation batches are identical; the rules only differ from the first bias update on (the
step-1 losses are equal, which the results record as ``same_first_loss``).

From each run's ``metrics.jsonl`` (``expert_load/layer{i}``: tokens each routed expert got in a step), per
step and MoE layer:

* **imbalance** ``max(load) / mean(load)`` (1 = perfectly balanced; top-k of n experts on m tokens has
  mean m·k/n), averaged and maxed over the MoE layers;
* **dead experts**: experts that got no token in the step, and experts that got no token in any of the
  last ``window`` steps (fewer at the start of a run), summed over the layers.

The table compares the rules over the last quarter of the steps (``TAIL_FRACTION``): the mean and the
maximum imbalance there, the dead experts per step there, the dead experts of the last window at the
end, and the final validation loss.

Outputs, for an output directory ``DIR``: ``DIR/balancing.md`` (tables), ``DIR/balancing.json`` (everything,
including the per-step curves) and ``DIR/balancing.png`` (imbalance, dead experts and validation loss vs
step per rule, and each rule's per-layer expert loads over the last window). Runs live in
``DIR/runs/{rule}`` and are reused when the command is repeated (``k2lab.ablations.common``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator
from rich.console import Console

from k2lab.ablations.common import (
    AblationSettings,
    PlannedRun,
    StudyRun,
    ordered_subset,
    recipe_settings,
    run_times,
    tokens_per_step,
    val_points,
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
from k2lab.errors import K2LabError
from k2lab.fsutil import save_figure_atomically
from k2lab.presets import load_preset
from k2lab.train.config import TrainConfig
from k2lab.train.metrics import read_metrics

RULES = ("none", "deepseek", "quantile")
LABELS = {"none": "none", "deepseek": "DeepSeek-V3 sign", "quantile": "Quantile Balancing"}
COLORS = {"none": "tab:gray", "deepseek": "tab:blue", "quantile": "tab:red"}
TAIL_FRACTION = 0.25  # the table's window: the last quarter of the steps

# k3-mini on the embedded corpus: 3 runs × 80 steps × 4×128 tokens in 3 one-thread worker processes,
# ~8 min of CPU time in all (~4-5 min on 2 free CPU cores; 100 steps took 11.5 CPU-min).
DEFAULT_RECIPE: dict[str, Any] = {
    "preset": "k3-mini",
    "steps": 80,
    "batch_size": 4,
    "seq_len": 128,
    "eval_batches": 4,
    "sample_tokens": 0,
    "schedule": {"kind": "wsd", "warmup_steps": 8, "decay_fraction": 0.2, "min_lr_ratio": 0.1},
}


class BalancingConfig(AblationSettings):
    """What to run: a base recipe (everything but the bias rule), the rules, the sign rule's γ, the window.

    ``jobs`` defaults to one worker process per rule, so the runs train side by side with ``threads``
    (default: this process's threads divided among the jobs, at least one) each: single-threaded processes
    use two cores fully without the OpenMP barrier stalls a 2-thread run suffers on a busy machine.
    """

    TEXT_ONLY = True
    BASE = DEFAULT_RECIPE
    EVAL_POINTS = 4  # validation every steps // 4 by default: the table needs the final loss only
    WHAT = "balancing ablation setting"

    rules: list[str] = Field(
        default_factory=lambda: list(RULES), description="Bias rules compared (of none, deepseek, quantile)"
    )
    gamma: float | None = Field(
        default=None,
        gt=0,
        description="Bias step γ of the DeepSeek-V3 sign rule (unset: the recipe's balance.gamma)",
    )
    window: int = Field(
        default=10, gt=0, description="An expert is dead at the end when it got no token in the last N steps"
    )
    jobs: int | None = Field(
        default=None, gt=0, description="Runs trained at once, in worker processes (unset: one per rule)"
    )
    out: str = Field(default="runs/balancing", description="Output directory")

    @field_validator("rules")
    @classmethod
    def _known_rules(cls, names: list[str]) -> list[str]:
        return ordered_subset(names, RULES, "rules")

    @model_validator(mode="after")
    def _resolve_defaults(self) -> BalancingConfig:
        if self.gamma is None:
            self.gamma = self.base.balance.gamma
        if self.jobs is None:
            self.jobs = len(self.rules)
        return self


def train_config(ablation: BalancingConfig, rule: str) -> TrainConfig:
    """The base recipe with this rule (γ only for the sign rule, so ``--gamma`` retrains that run alone)."""
    update: dict[str, Any] = {"bias_rule": rule}
    if rule == "deepseek":
        update["gamma"] = ablation.gamma
    balance = ablation.base.balance.model_copy(update=update)
    return with_updates(ablation.base, balance=balance, out=str(Path(ablation.out) / "runs" / rule))


# ---- analysis --------------------------------------------------------------------------------------------
def expert_loads(records: list[dict[str, Any]]) -> tuple[list[int], torch.Tensor]:
    """The MoE layer indices and the per-step loads [steps, layers, experts] of a run's metrics."""
    layers = sorted(
        int(key.removeprefix("expert_load/layer")) for key in records[0] if key.startswith("expert_load/")
    )
    if not layers:
        raise K2LabError("the runs logged no expert loads: the preset has no MoE layer")
    loads = torch.tensor([[r[f"expert_load/layer{i}"] for i in layers] for r in records], dtype=torch.float64)
    return layers, loads


def trailing_sums(values: torch.Tensor, window: int) -> torch.Tensor:
    """Sums of ``values`` over the last ``window`` entries along dim 0 (all entries so far at the start)."""
    totals = values.cumsum(0)
    return totals - torch.cat([torch.zeros_like(totals[:window]), totals[:-window]])


def balance_curves(loads: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
    """Per step and layer [steps, layers]: imbalance (max/mean), dead experts in the step, and dead experts
    over the trailing ``window`` steps (the steps so far while fewer than ``window`` have run)."""
    imbalance = loads.amax(-1) / loads.mean(-1).clamp(min=1e-9)
    dead = (loads == 0).sum(-1)
    return {"imbalance": imbalance, "dead": dead, "dead_window": (trailing_sums(loads, window) == 0).sum(-1)}


def summarize_run(config: TrainConfig, summary: dict, reused: bool, window: int) -> dict[str, Any]:
    """One run's balance figures and curves from its ``metrics.jsonl``."""
    records = read_metrics(config.out)
    layers, loads = expert_loads(records)
    curves = balance_curves(loads, window)
    steps, n_layers, n_experts = loads.shape
    tail = max(1, math.ceil(steps * TAIL_FRACTION))
    imbalance, dead, dead_window = curves["imbalance"], curves["dead"], curves["dead_window"]
    recent = loads[-window:].sum(0)  # [layers, experts]
    val = val_points(records)
    return {
        "rule": config.balance.bias_rule,
        "gamma": config.balance.gamma if config.balance.bias_rule == "deepseek" else None,
        "run_dir": str(config.out),
        "steps": steps,
        "tokens": steps * tokens_per_step(config),
        "moe_layers": layers,
        "n_experts": n_experts,
        "tail_steps": tail,
        "first_loss": float(records[0]["loss"]),
        "final_val_loss": val[-1][1] if val else math.nan,
        "val_curve": [{"step": s, "val_loss": v} for s, v in val],
        "loss": [float(r["loss"]) for r in records],
        "imbalance_mean": imbalance.mean(1).tolist(),
        "imbalance_max": imbalance.amax(1).tolist(),
        "dead": dead.sum(1).tolist(),
        "dead_window": dead_window.sum(1).tolist(),
        "tail_imbalance_mean": float(imbalance[-tail:].mean()),
        "tail_imbalance_max": float(imbalance[-tail:].max()),
        "tail_imbalance_by_layer": imbalance[-tail:].mean(0).tolist(),
        "tail_dead_per_step": float(dead[-tail:].sum(1).double().mean()),
        "dead_at_end": int(dead_window[-1].sum()),
        "dead_at_end_by_layer": dead_window[-1].tolist(),
        "final_relative_loads": (recent / recent.mean(-1, keepdim=True).clamp(min=1e-9)).tolist(),
        **run_times(summary, reused),
        "slots": n_layers * n_experts,
    }


def run_balancing(ablation: BalancingConfig, console: Console | None = None) -> dict[str, Any]:
    """Train every rule's run (or reuse it), analyse, write DIR/balancing.{json,md,png}; returns the results."""
    study = StudyRun(ablation, console or Console())
    configs = [train_config(ablation, rule) for rule in ablation.rules]
    plan = [
        PlannedRun(
            config,
            f"bias rule {LABELS[config.balance.bias_rule]}"
            + (f" (γ {config.balance.gamma:g})" if config.balance.bias_rule == "deepseek" else "")
            + f", {config.steps} steps → {config.out}",
            config.balance.bias_rule,
        )
        for config in configs
    ]

    def describe(index: int, summary: dict) -> str:
        run = summarize_run(configs[index], summary, False, ablation.window)
        return (
            f"{LABELS[run['rule']]}: imbalance {run['tail_imbalance_mean']:.3f} (last {run['tail_steps']} "
            f"steps), dead at end {run['dead_at_end']}/{run['slots']}, final val loss {run['final_val_loss']:.4f}"
        )

    outcomes = study.train(plan, describe)
    runs = [
        summarize_run(config, summary, reused, ablation.window)
        for config, (summary, reused) in zip(configs, outcomes, strict=True)
    ]
    return study.finish(analyse(ablation, runs), runs, REPORT)


def analyse(ablation: BalancingConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Settings, the runs, and the fairness checks (same tokens, same step-1 loss)."""
    base = ablation.base
    model = load_preset(base.preset, **base.model_overrides)
    return {
        "settings": {
            **recipe_settings(base),
            "optimizer": base.optimizer.name,
            "lr": base.optimizer.lr,
            "schedule": base.schedule.model_dump(mode="json"),
            "eval_every": base.eval_every,
            "eval_batches": base.eval_batches,
            "sequence_loss_alpha": base.balance.sequence_loss_alpha,
            "gamma": ablation.gamma,
            "rules": ablation.rules,
            "n_experts": model.n_routed_experts,
            "top_k": model.num_experts_per_tok,
            "window": ablation.window,
            "tail_fraction": TAIL_FRACTION,
        },
        "runs": runs,
        "same_tokens": len({run["tokens"] for run in runs}) == 1,
        "same_first_loss": len({run["first_loss"] for run in runs}) == 1,
    }


# ---- outputs ---------------------------------------------------------------------------------------------
def _rule_name(run: dict[str, Any]) -> str:
    gamma = f" (γ {run['gamma']:g})" if run["gamma"] is not None else ""
    return LABELS[run["rule"]] + gamma


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """The comparison table's cells, one row per rule (shared by the markdown and the console table)."""
    return [
        [
            _rule_name(run),
            fmt(run["tail_imbalance_mean"]),
            fmt(run["tail_imbalance_max"]),
            fmt(run["tail_dead_per_step"], ".1f"),
            f"{run['dead_at_end']} / {run['slots']}",
            fmt(run["final_val_loss"], ".4f"),
        ]
        for run in results["runs"]
    ]


def table_header(results: dict[str, Any]) -> list[str]:
    s, tail = results["settings"], results["runs"][0]["tail_steps"]
    return [
        "bias rule",
        f"mean max/mean load (last {tail} steps)",
        f"max max/mean load (last {tail} steps)",
        f"dead experts per step (last {tail} steps)",
        f"dead at end (no token in last {s['window']} steps)",
        "final val loss",
    ]


def markdown_report(results: dict[str, Any]) -> str:
    """The tables of ``balancing.md``."""
    s = results["settings"]
    runs = results["runs"]
    n_layers = len(runs[0]["moe_layers"])
    fair = "equal" if results["same_first_loss"] else "NOT equal (the runs are not comparable)"
    by_layer = [[_rule_name(run), *(fmt(v) for v in run["tail_imbalance_by_layer"])] for run in runs]
    lines = [
        f"# Router-bias ablation: {s['preset']}, {s['steps']} steps × {s['tokens_per_step']:,} tokens "
        f"({s['tokens']:,} tokens per rule)",
        "",
        f"Same initial weights (seed {s['seed']}), data order, lr ({s['optimizer']} {s['lr']:g}, schedule "
        f"{s['schedule']['kind']}), batch and evaluation batches for every rule; step-1 losses {fair}. "
        f"Data: {s['data']}; precision {s['precision']}; {s['n_experts']} routed experts, top-{s['top_k']}, "
        f"{n_layers} MoE layers (mean load per expert and step {s['tokens_per_step'] * s['top_k'] / s['n_experts']:g} "
        f"tokens); DeepSeek-V3 sign rule γ = {s['gamma']:g}; sequence-wise balance loss α = "
        f"{s['sequence_loss_alpha']:g}.",
        "",
        "Imbalance is max/mean of the experts' token counts in one step of one MoE layer, averaged (mean) or "
        "maxed (max) over the layers and the steps of the window; dead experts are summed over the layers "
        f"(of {n_layers} × {s['n_experts']} = {runs[0]['slots']}).",
        "",
        *md_table(table_header(results), table_rows(results)),
        "",
        f"## Mean max/mean load per MoE layer (last {runs[0]['tail_steps']} steps)",
        "",
        *md_table(["bias rule", *(f"layer {i}" for i in runs[0]["moe_layers"])], by_layer),
        "",
        timing_note(results, len(runs)),
        "",
    ]
    return "\n".join(lines)


def _rolling_mean(values: list[float], window: int) -> list[float]:
    counts = torch.arange(1, len(values) + 1).clamp(max=window)
    return (trailing_sums(torch.tensor(values, dtype=torch.float64), window) / counts).tolist()


def plot_balancing(results: dict[str, Any], target: Path) -> Path:
    """``balancing.png``: imbalance, dead experts and val loss vs step; per-layer loads at the end per rule."""
    s = results["settings"]
    figure = new_figure((15, 9))
    top, bottom = figure.subfigures(2, 1, height_ratios=[1.1, 1])
    figure.suptitle(
        f"Router-bias ablation: {s['preset']}, {s['tokens']:,} tokens per rule, same data and init",
        fontsize=14,
    )
    _curves(top.subplots(1, 3), results)
    _final_loads(bottom, results)
    return save_figure_atomically(figure, target)


def _curves(axes: Any, results: dict[str, Any]) -> None:
    """Imbalance, dead experts and loss vs step, one colour per rule."""
    runs, window = results["runs"], results["settings"]["window"]
    imbalance_ax, dead_ax, loss_ax = axes
    for run in runs:
        steps = range(1, run["steps"] + 1)
        color, label = COLORS[run["rule"]], _rule_name(run)
        imbalance_ax.plot(steps, run["imbalance_mean"], color=color, alpha=0.25, linewidth=0.8)
        imbalance_ax.plot(
            steps, _rolling_mean(run["imbalance_mean"], window), color=color, linewidth=2, label=label
        )
        imbalance_ax.plot(steps, run["imbalance_max"], color=color, linestyle=":", linewidth=1)
        dead_ax.plot(steps, run["dead"], color=color, alpha=0.35, linewidth=0.8)
        dead_ax.plot(steps, run["dead_window"], color=color, linewidth=2, label=label)
        loss_ax.plot(steps, _rolling_mean(run["loss"], window), color=color, alpha=0.5, linewidth=1)
        plot_val_curve(loss_ax, run["val_curve"], color=color, label=label)
    imbalance_ax.axhline(1.0, color="black", linewidth=0.8)
    imbalance_ax.set_title(
        "expert load imbalance, mean over MoE layers\n"
        f"(thin: per step; bold: {window}-step mean; dotted: worst layer)",
        fontsize=10,
    )
    dead_ax.set_title(
        "dead experts, summed over MoE layers\n"
        f"(thin: no token in the step; bold: none in the last {window} steps)",
        fontsize=10,
    )
    loss_ax.set_title(
        f"loss (thin: training, {window}-step mean; markers: validation)\n"
        "(same tokens and evaluation batches for every rule)",
        fontsize=10,
    )
    finish_axes(imbalance_ax, "step", "max / mean tokens per expert")
    finish_axes(dead_ax, "step", f"experts (of {runs[0]['slots']})")
    finish_axes(loss_ax, "step", "nats/token")


def _final_loads(bottom: Any, results: dict[str, Any]) -> None:
    """One heat map per rule: each expert's tokens over the last window relative to the layer's mean."""
    from matplotlib.colors import TwoSlopeNorm  # lazy: matplotlib (0.3 s) only to draw

    runs, window = results["runs"], results["settings"]["window"]
    heat_axes = bottom.subplots(1, len(runs), squeeze=False)[0]
    vmax = max(max(max(row) for row in run["final_relative_loads"]) for run in runs)
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(vmax, 1.01))
    image = None
    for ax, run in zip(heat_axes, runs, strict=True):
        image = ax.imshow(run["final_relative_loads"], cmap="coolwarm", norm=norm, aspect="auto")
        ax.set_title(f"{_rule_name(run)}: load / mean, last {window} steps", fontsize=9)
        ax.set_xlabel("expert")
        ax.set_yticks(range(len(run["moe_layers"])), [f"layer {i}" for i in run["moe_layers"]])
    if image is not None:
        bottom.colorbar(image, ax=list(heat_axes), label="tokens / mean tokens (0 = dead)")


def print_summary(results: dict[str, Any], console: Console) -> None:
    """The comparison as a rich table, and a warning when the runs did not start equal."""
    s = results["settings"]
    title = f"router bias rules: {s['preset']}, {s['steps']} steps × {s['tokens_per_step']:,} tokens"
    console.print(rich_table(title, table_header(results), table_rows(results)))
    if not results["same_first_loss"]:
        console.print(
            "[yellow]warning:[/] the runs' step-1 losses differ: they did not start from the same state"
        )


REPORT = Report("balancing", markdown_report, plot_balancing, print_summary)
