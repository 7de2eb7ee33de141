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
``DIR/runs/{rule}`` and are reused when the command is repeated (``k2lab.train.ablation_common``).
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, field_validator
from rich.console import Console
from rich.table import Table

from k2lab.errors import K2LabError
from k2lab.fsutil import save_figure_atomically
from k2lab.train import ablation_common as common
from k2lab.train.ablation_common import AblationSettings, PlannedRun, fmt
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
EVAL_POINTS = 4  # validation every steps // 4 by default: the table needs the final loss only


class BalancingConfig(AblationSettings):
    """What to run: a base recipe (everything but the bias rule), the rules, the sign rule's γ, the window."""

    rules: list[str] = Field(default_factory=lambda: list(RULES))
    gamma: float = Field(default=1e-3, gt=0, description="Step of the DeepSeek-V3 sign rule.")
    window: int = Field(default=10, gt=0, description="Dead experts: no token in the last `window` steps.")
    out: str = "runs/balancing"

    @field_validator("rules")
    @classmethod
    def _known_rules(cls, names: list[str]) -> list[str]:
        return common.ordered_subset(names, RULES, "rules")


def balancing_config(
    recipe: str | os.PathLike[str] | None = None,
    rules: list[str] | None = None,
    gamma: float | None = None,
    window: int = 10,
    out: str | None = None,
    keep_weights: bool = False,
    threads: int | None = None,
    jobs: int | None = None,
    **overrides: Any,
) -> BalancingConfig:
    """The ablation from ``DEFAULT_RECIPE``, then ``recipe`` (TOML), then the ``TrainConfig`` overrides
    (dotted keys, None ignored), e.g. ``preset="k3-nano", steps=20, **{"optimizer.lr": 3e-3}``.

    ``gamma`` defaults to the recipe's ``balance.gamma`` (1e-3). ``jobs`` defaults to one worker process
    per rule, so the runs train side by side with ``threads`` (default: this process's threads divided
    among the jobs, at least one) each: single-threaded processes use two cores fully without the OpenMP
    barrier stalls a 2-thread run suffers on a busy machine.
    """
    base = common.base_recipe(DEFAULT_RECIPE, recipe, eval_points=EVAL_POINTS, **overrides)
    try:
        return BalancingConfig(
            base=base,
            rules=rules or list(RULES),
            gamma=gamma if gamma is not None else base.balance.gamma,
            window=window,
            out=out or "runs/balancing",
            keep_weights=keep_weights,
            threads=threads,
            jobs=jobs if jobs is not None else len(set(rules or RULES)),
        )
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        raise K2LabError(f"invalid balancing ablation setting: {error}") from error


def parse_rules(text: str) -> list[str]:
    """'quantile, none' -> ['none', 'quantile'] (checked against ``RULES``, in their order)."""
    try:
        return common.ordered_subset([part for part in re.split(r"[\s,]+", text) if part], RULES, "--rules")
    except ValueError as error:
        raise K2LabError(str(error)) from error


def train_config(ablation: BalancingConfig, rule: str) -> TrainConfig:
    """The base recipe with this rule (γ only for the sign rule, so ``--gamma`` retrains that run alone)."""
    update: dict[str, Any] = {"bias_rule": rule}
    if rule == "deepseek":
        update["gamma"] = ablation.gamma
    balance = ablation.base.balance.model_copy(update=update)
    return common.with_updates(ablation.base, balance=balance, out=str(Path(ablation.out) / "runs" / rule))


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
    tokens_per_step = config.batch_size * config.seq_len * config.grad_accum
    val = [(r["step"], float(r["val_loss"])) for r in records if "val_loss" in r]
    return {
        "rule": config.balance.bias_rule,
        "gamma": config.balance.gamma if config.balance.bias_rule == "deepseek" else None,
        "run_dir": str(config.out),
        "steps": steps,
        "tokens": steps * tokens_per_step,
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
        "seconds": summary.get("seconds", math.nan),
        "cpu_seconds": summary.get("cpu_seconds", math.nan),
        "reused": reused,
        "slots": n_layers * n_experts,
    }


def run_balancing(ablation: BalancingConfig, console: Console | None = None) -> dict[str, Any]:
    """Train every rule's run (or reuse it), analyse, write DIR/balancing.{json,md,png}; returns the results."""
    console = console or Console()
    out = Path(ablation.out)
    out.mkdir(parents=True, exist_ok=True)
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
    start = time.perf_counter()

    def report(index: int, summary: dict, reused: bool) -> None:
        run = summarize_run(configs[index], summary, reused, ablation.window)
        console.print(
            f"[{index + 1}/{len(plan)}] {LABELS[run['rule']]}: imbalance {run['tail_imbalance_mean']:.3f} "
            f"(last {run['tail_steps']} steps), dead at end {run['dead_at_end']}/{run['slots']}, final val "
            f"loss {run['final_val_loss']:.4f}{' (reused)' if reused else ''}; "
            f"elapsed {time.perf_counter() - start:.0f}s"
        )

    outcomes, per_run = common.train_runs(plan, ablation, console, report)
    runs = [
        summarize_run(config, summary, reused, ablation.window)
        for config, (summary, reused) in zip(configs, outcomes, strict=True)
    ]
    results = analyse(ablation, runs)
    common.record_times(results, runs, ablation, per_run, start)
    paths = common.write_outputs(results, out, "balancing", markdown_report, plot_balancing)
    print_summary(results, console)
    console.print("wrote " + ", ".join(map(str, paths)))
    return results


def analyse(ablation: BalancingConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Settings, the runs, and the fairness checks (same tokens, same step-1 loss)."""
    from k2lab.presets import load_preset

    base = ablation.base
    model = load_preset(base.preset, **base.model_overrides)
    return {
        "settings": {
            **common.recipe_settings(base),
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
        "| " + " | ".join(table_header(results)) + " |",
        "|---|" + "---|" * (len(table_header(results)) - 1),
        *("| " + " | ".join(row) + " |" for row in table_rows(results)),
        "",
        f"## Mean max/mean load per MoE layer (last {runs[0]['tail_steps']} steps)",
        "",
        "| bias rule | " + " | ".join(f"layer {i}" for i in runs[0]["moe_layers"]) + " |",
        "|---|" + "---|" * n_layers,
    ]
    for run in runs:
        lines.append(
            f"| {_rule_name(run)} | " + " | ".join(fmt(v) for v in run["tail_imbalance_by_layer"]) + " |"
        )
    lines += [
        "",
        common.timing_note(results, len(runs)),
        "",
    ]
    return "\n".join(lines)


def _rolling_mean(values: list[float], window: int) -> list[float]:
    counts = torch.arange(1, len(values) + 1).clamp(max=window)
    return (trailing_sums(torch.tensor(values, dtype=torch.float64), window) / counts).tolist()


def plot_balancing(results: dict[str, Any], target: Path) -> Path:
    """``balancing.png``: imbalance, dead experts and val loss vs step; per-layer loads at the end per rule."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    s, runs = results["settings"], results["runs"]
    window = s["window"]
    figure = Figure(figsize=(15, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subfigures(2, 1, height_ratios=[1.1, 1])
    figure.suptitle(
        f"Router-bias ablation: {s['preset']}, {s['tokens']:,} tokens per rule, same data and init",
        fontsize=14,
    )
    imbalance_ax, dead_ax, loss_ax = top.subplots(1, 3)
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
        curve = run["val_curve"]
        loss_ax.plot(
            [p["step"] for p in curve], [p["val_loss"] for p in curve], color=color, marker="o", label=label
        )
    imbalance_ax.axhline(1.0, color="black", linewidth=0.8)
    imbalance_ax.set_title(
        "expert load imbalance, mean over MoE layers\n"
        f"(thin: per step; bold: {window}-step mean; dotted: worst layer)",
        fontsize=10,
    )
    imbalance_ax.set_ylabel("max / mean tokens per expert")
    dead_ax.set_title(
        "dead experts, summed over MoE layers\n"
        f"(thin: no token in the step; bold: none in the last {window} steps)",
        fontsize=10,
    )
    dead_ax.set_ylabel(f"experts (of {runs[0]['slots']})")
    loss_ax.set_title(
        f"loss (thin: training, {window}-step mean; markers: validation)\n"
        "(same tokens and evaluation batches for every rule)",
        fontsize=10,
    )
    loss_ax.set_ylabel("nats/token")
    for ax in (imbalance_ax, dead_ax, loss_ax):
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)

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
    return save_figure_atomically(figure, target)


def print_summary(results: dict[str, Any], console: Console) -> None:
    """The comparison as a rich table, and a warning when the runs did not start equal."""
    s = results["settings"]
    table = Table(
        title=f"router bias rules: {s['preset']}, {s['steps']} steps × {s['tokens_per_step']:,} tokens"
    )
    for index, column in enumerate(table_header(results)):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in table_rows(results):
        table.add_row(*row)
    console.print(table)
    if not results["same_first_loss"]:
        console.print(
            "[yellow]warning:[/] the runs' step-1 losses differ: they did not start from the same state"
        )
