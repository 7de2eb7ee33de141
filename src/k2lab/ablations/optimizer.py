"""Optimizer ablation: AdamW, Muon and MuonClip trained on the same tokens from the same initial weights.

Every run is one ``run_training`` call with the same recipe except ``optimizer.name`` / ``optimizer.lr`` /
``optimizer.qk_clip_tau`` (and its run directory), so data order, model initialisation, schedule, batch,
evaluation batches and precision are identical across runs. With ``adjust_lr_fn = "match_rms_adamw"``
(Moonlight's update-RMS matching, the default) Muon's lr lives on AdamW's scale, so one lr grid serves all.

The ablation, for an output directory ``DIR``:

1. **sweep**: every optimizer at every lr of the grid (``DIR/runs/{optimizer}-lr{lr}``); the best lr of an
   optimizer is the one with the lowest final validation loss (a diverged run, NaN, never wins);
2. **comparison** of the best runs: validation loss at equal tokens (the shared evaluation points), tokens
   each needs to reach a target validation loss (default: the worst best-run's final validation loss,
   linearly interpolated between evaluation points), token efficiency ``tokens(AdamW) / tokens(x)``, and
   the max-logit trajectories;
3. **stress** (``DIR/stress/...``): plain Muon and MuonClip at a higher lr and a low τ, where Muon's max
   attention logit runs past τ while MuonClip rescales every head back to τ after each step
   (``max_logit_clipped ≤ τ``; ``max_logit``, the next forward's maximum before clipping, is reported too).

Outputs: ``DIR/ablation.json`` (everything, including the curves), ``DIR/ablation.md`` (tables) and
``DIR/ablation.png`` (validation loss vs tokens; final loss vs lr; max logit vs step with τ; stress).

A run directory that already holds a finished run of exactly the same recipe (``ablation_run.json``) is
reused, so an interrupted ablation continues where it stopped. Checkpoints and final weights of the runs
are deleted once a run finishes unless ``keep_weights`` (an ablation of 11 k2-mini runs would keep ~3 GB).
Finished runs can therefore also be produced by separate invocations (``optimizers`` subsets, one with
``stress=None``) and gathered by a final full invocation that only reuses them.

``jobs > 1`` trains that many runs at once in spawned worker processes (output in ``DIR/logs/``), each
with ``threads`` torch threads (default: the threads divided among the jobs). On a shared machine whose
cores are busy with other work, one thread per process also avoids OpenMP barrier stalls that can make a
2-thread step 10-30x slower. Runs are deterministic: the same recipe with the same thread count gives the
same losses in any process.

On the WSD schedule the final evaluation sits after the lr decay, which lowers the loss quickly; the worst
run reaches the default target only there, while better runs may cross it during the constant phase. The
token efficiency reported is therefore a lower bound of what equal schedules would give.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from rich.console import Console

from k2lab.ablations.common import (
    AblationSettings,
    PlannedRun,
    StudyRun,
    ordered_subset,
    recipe_settings,
    run_times,
    tokens_per_step,
    with_updates,
)
from k2lab.ablations.report import (
    Report,
    finish_axes,
    fmt,
    md_table,
    new_figure,
    rich_table,
    timing_note,
)
from k2lab.fsutil import save_figure_atomically
from k2lab.train.config import TrainConfig
from k2lab.train.metrics import read_metrics

OPTIMIZERS = ("adamw", "muon", "muonclip")
LABELS = {"adamw": "AdamW", "muon": "Muon", "muonclip": "MuonClip"}
COLORS = {"adamw": "tab:blue", "muon": "tab:orange", "muonclip": "tab:green"}
STYLES = {
    "adamw": "-",
    "muon": "-",
    "muonclip": "--",
}  # MuonClip = Muon until a head passes τ: keep both visible

# The default (full) ablation: k2-mini on the embedded corpus, sized for ~30 min on 2 CPU cores.
FULL_RECIPE: dict[str, Any] = {
    "preset": "k2-mini",
    "steps": 150,
    "batch_size": 8,
    "seq_len": 256,
    "eval_batches": 4,
    "sample_tokens": 8,
    "schedule": {"kind": "wsd", "warmup_steps": 15, "decay_fraction": 0.2, "min_lr_ratio": 0.1},
}
FULL_LRS = (3e-4, 1e-3, 3e-3)  # brackets the optimum (1e-3) of every optimizer at 150 steps

# ``--quick``: a smoke run of the same pipeline (k2-nano, a 2 MB slice of the corpus, a few steps), as an
# overlay of the settings applied before the recipe, ``--set`` and the options.
QUICK: dict[str, Any] = {
    "base": {
        "preset": "k2-nano",
        "vocab_size": 512,
        "data_max_bytes": 2_000_000,
        "steps": 30,
        "batch_size": 4,
        "seq_len": 64,
        "eval_batches": 2,
        "sample_tokens": 4,
        "precision": "fp32",
        "schedule": {"kind": "wsd", "warmup_steps": 3, "decay_fraction": 0.2, "min_lr_ratio": 0.1},
    },
    "lrs": [3e-3, 1e-2, 3e-2],
    "stress": {"lr": 5e-2, "tau": 2.0},
    "out": "runs/ablation-quick",
    "threads": 1,
}


class StressConfig(BaseModel):
    """The setting where QK-Clip has to act: plain Muon vs MuonClip at a high lr and a low τ."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=3e-2, gt=0, description="Stress setting lr")
    tau: float = Field(default=10.0, gt=0, description="Stress setting τ")
    steps: int | None = Field(
        default=None, gt=0, description="Stress setting steps (unset: min(the sweep's steps, 100))"
    )


class AblationConfig(AblationSettings):
    """What to run: a base recipe (everything but the optimizer), the lr grid, τ, the stress setting.

    The base recipe's ``[optimizer]`` table sets everything but the name, lr and τ, which the ablation
    varies.
    """

    TEXT_ONLY = True
    BASE = FULL_RECIPE
    WHAT = "ablation setting"

    optimizers: list[str] = Field(
        default_factory=lambda: list(OPTIMIZERS), description="Optimizers compared (of adamw, muon, muonclip)"
    )
    lrs: list[float] = Field(
        default_factory=lambda: list(FULL_LRS), min_length=1, description="lr grid of every optimizer"
    )
    tau: float | None = Field(
        default=None, gt=0, description="MuonClip's τ in the sweep (unset: the base recipe's qk_clip_tau)"
    )
    target_loss: float | None = Field(
        default=None, description="Target val loss (unset: the worst best-run's final val loss)"
    )
    stress: StressConfig | None = Field(default_factory=StressConfig)
    out: str = Field(default="runs/ablation", description="Output directory")

    @field_validator("optimizers")
    @classmethod
    def _known_optimizers(cls, names: list[str]) -> list[str]:
        return ordered_subset(names, OPTIMIZERS, "optimizers")

    @field_validator("lrs")
    @classmethod
    def _positive_lrs(cls, lrs: list[float]) -> list[float]:
        if any(not 0 < lr < math.inf for lr in lrs):
            raise ValueError(f"learning rates must be positive and finite, got {lrs}")
        return sorted(set(lrs))

    @model_validator(mode="after")
    def _sweep_tau(self) -> AblationConfig:
        if self.tau is None:
            self.tau = self.base.optimizer.qk_clip_tau
        return self


# ---- configuration -------------------------------------------------------------------------------------
def run_name(optimizer: str, lr: float, tau: float | None = None) -> str:
    name = f"{optimizer}-lr{lr:g}"
    return name if tau is None else f"{name}-tau{tau:g}"


def train_config(
    ablation: AblationConfig, optimizer: str, lr: float, tau: float, out: Path, steps: int | None = None
) -> TrainConfig:
    """The base recipe with this run's optimizer, lr, τ, run directory (and steps)."""
    # adamw_lr is cleared: the swept lr is the lr of every group (one scale with match_rms_adamw).
    settings = ablation.base.optimizer.model_copy(
        update={"name": optimizer, "lr": lr, "qk_clip_tau": tau, "adamw_lr": None}
    )
    update: dict[str, Any] = {"optimizer": settings, "out": str(out)}
    if steps is not None and steps != ablation.base.steps:
        update.update(steps=steps, save_every=steps, eval_every=max(1, steps // 10))
    return with_updates(ablation.base, **update)


# ---- running ---------------------------------------------------------------------------------------------
def summarize_run(config: TrainConfig, summary: dict, reused: bool) -> dict[str, Any]:
    """One run's figures and curves from its ``metrics.jsonl``."""
    records = read_metrics(config.out)
    per_step = tokens_per_step(config)
    val = [(r["step"], r["step"] * per_step, float(r["val_loss"])) for r in records if "val_loss" in r]
    max_logit = [float(r.get("max_logit", math.nan)) for r in records]
    clipped_max = [float(r.get("max_logit_clipped", math.nan)) for r in records]
    tau = config.optimizer.qk_clip_tau
    finite = [v for v in max_logit if math.isfinite(v)]
    speeds = [float(r["tokens_per_s"]) for r in records if "tokens_per_s" in r]
    return {
        "name": Path(config.out).name,
        "optimizer": config.optimizer.name,
        "lr": config.optimizer.lr,
        "tau": tau,
        "run_dir": str(config.out),
        "steps": len(records),
        "tokens": len(records) * per_step,
        "final_val_loss": val[-1][2] if val else math.nan,
        "unigram_baseline": summary.get("unigram_baseline", math.nan),
        "val_curve": [{"step": s, "tokens": t, "val_loss": v} for s, t, v in val],
        "loss": [float(r.get("loss", math.nan)) for r in records],
        "max_logit": max_logit,
        "max_logit_clipped": clipped_max,
        "peak_max_logit": max(finite) if finite else math.nan,
        "peak_max_logit_clipped": max((v for v in clipped_max if math.isfinite(v)), default=math.nan),
        "steps_above_tau": sum(v > tau for v in finite),
        "clipped_heads_total": sum(float(r.get("qk_clipped_heads", 0)) for r in records),
        "qk_clip_ever_frac": float(records[-1].get("qk_clip_ever_frac", 0.0)) if records else 0.0,
        "median_tokens_per_s": statistics.median(speeds) if speeds else math.nan,
        **run_times(summary, reused),
    }


def run_plan(ablation: AblationConfig) -> list[tuple[str, TrainConfig]]:
    """The runs of the ablation in order: (``"sweep"`` or ``"stress"``, recipe)."""
    out = Path(ablation.out)
    plan: list[tuple[str, TrainConfig]] = []
    for optimizer in ablation.optimizers:
        for lr in ablation.lrs:
            run_dir = out / "runs" / run_name(optimizer, lr)
            plan.append(("sweep", train_config(ablation, optimizer, lr, ablation.tau, run_dir)))
    if ablation.stress is not None:
        stress = ablation.stress
        steps = stress.steps or min(ablation.base.steps, 100)
        for optimizer in ("muon", "muonclip"):
            run_dir = out / "stress" / run_name(optimizer, stress.lr, stress.tau)
            plan.append(("stress", train_config(ablation, optimizer, stress.lr, stress.tau, run_dir, steps)))
    return plan


def _setting(config: TrainConfig, sep: str = ", ") -> str:
    """ "MuonClip, lr 0.001, τ 100": the optimizer, lr and τ of a run."""
    optimizer = config.optimizer
    return f"{LABELS[optimizer.name]}{sep}lr {optimizer.lr:g}{sep}τ {optimizer.qk_clip_tau:g}"


def run_ablation(ablation: AblationConfig, console: Console | None = None) -> dict[str, Any]:
    """Train every run (or reuse it), analyse, write DIR/ablation.{json,md,png}; returns the results.

    With ``jobs == 1`` the runs train one after another in this process (live progress). With more jobs
    they train in that many worker processes (spawned), each with ``threads`` torch threads (default:
    this process's threads divided among the jobs) and its output in ``DIR/logs/{run}.log``.
    """
    study = StudyRun(ablation, console or Console())
    kinds = run_plan(ablation)
    plan = [
        PlannedRun(
            config,
            f"{kind}: {_setting(config)}, {config.steps} steps → {config.out}",
            f"{kind}-{Path(config.out).name}",
        )
        for kind, config in kinds
    ]

    def describe(index: int, summary: dict) -> str:
        kind, config = kinds[index]
        result = summarize_run(config, summary, False)
        return (
            f"{kind}: {_setting(config, ' ')}: final val loss {result['final_val_loss']:.4f}, "
            f"peak max logit {result['peak_max_logit']:.2f}"
        )

    outcomes = study.train(plan, describe)
    sweep: list[dict[str, Any]] = []
    stressed: list[dict[str, Any]] = []
    for (kind, config), (summary, reused) in zip(kinds, outcomes, strict=True):
        (sweep if kind == "sweep" else stressed).append(summarize_run(config, summary, reused))
    return study.finish(analyse(ablation, sweep, stressed), [*sweep, *stressed], REPORT)


# ---- analysis --------------------------------------------------------------------------------------------
def _sort_key(run: dict[str, Any]) -> float:
    loss = run["final_val_loss"]
    return loss if math.isfinite(loss) else math.inf


def tokens_to_reach(curve: list[dict[str, float]], target: float) -> float | None:
    """Tokens at which a validation curve first reaches ``target`` (linear between evaluation points)."""
    previous = None
    for point in curve:
        if math.isfinite(point["val_loss"]) and point["val_loss"] <= target:
            if previous is None or not math.isfinite(previous["val_loss"]):
                return float(point["tokens"])
            fraction = (previous["val_loss"] - target) / (previous["val_loss"] - point["val_loss"])
            return previous["tokens"] + fraction * (point["tokens"] - previous["tokens"])
        previous = point
    return None


def analyse(
    ablation: AblationConfig, sweep: list[dict[str, Any]], stressed: list[dict[str, Any]]
) -> dict[str, Any]:
    """Best lr per optimizer, equal-token losses, tokens to target, efficiency, stress verdict."""
    base = ablation.base
    best: dict[str, dict[str, Any]] = {}
    for optimizer in ablation.optimizers:
        runs = [run for run in sweep if run["optimizer"] == optimizer]
        best[optimizer] = min(runs, key=_sort_key)
    finals = [run["final_val_loss"] for run in best.values() if math.isfinite(run["final_val_loss"])]
    target = (
        ablation.target_loss if ablation.target_loss is not None else (max(finals) if finals else math.nan)
    )
    reference = "adamw" if "adamw" in best else next(iter(best))
    reached = {name: tokens_to_reach(run["val_curve"], target) for name, run in best.items()}
    comparison = {}
    for name, run in best.items():
        tokens, ref_tokens = reached[name], reached[reference]
        comparison[name] = {
            "lr": run["lr"],
            "final_val_loss": run["final_val_loss"],
            "tokens_to_target": tokens,
            "token_efficiency_vs_" + reference: (ref_tokens / tokens) if tokens and ref_tokens else None,
            "peak_max_logit": run["peak_max_logit"],
            "qk_clip_ever_frac": run["qk_clip_ever_frac"],
            "median_tokens_per_s": run["median_tokens_per_s"],
        }
    stress = None
    if stressed and ablation.stress is not None:
        by_name = {run["optimizer"]: run for run in stressed}
        tau = ablation.stress.tau
        muon, clip = by_name.get("muon"), by_name.get("muonclip")
        stress = {
            "lr": ablation.stress.lr,
            "tau": tau,
            "steps": stressed[0]["steps"],
            "runs": {run["optimizer"]: _stress_row(run) for run in stressed},
            "muon_exceeds_tau": bool(muon and muon["peak_max_logit"] > tau),
            # max_logit_clipped is min(S_max, τ) in fp32: τ itself may round up by one fp32 ulp.
            "muonclip_clipped_within_tau": bool(clip and clip["peak_max_logit_clipped"] <= tau * (1 + 1e-6)),
        }
        stress["demonstrated"] = stress["muon_exceeds_tau"] and stress["muonclip_clipped_within_tau"]
    return {
        "settings": {
            **recipe_settings(base),
            "lrs": ablation.lrs,
            "tau": ablation.tau,
            "adjust_lr_fn": base.optimizer.adjust_lr_fn,
            "weight_decay": base.optimizer.weight_decay,
            "stress": ablation.stress.model_dump() if ablation.stress else None,
        },
        "runs": sweep,
        "stress_runs": stressed,
        "best": {name: run["name"] for name, run in best.items()},
        "target_loss": target,
        "target_rule": "given" if ablation.target_loss is not None else "worst best-run final val loss",
        "reference": reference,
        "comparison": comparison,
        "equal_tokens": equal_token_losses(best),
        "stress": stress,
    }


def _stress_row(run: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "lr",
        "tau",
        "peak_max_logit",
        "peak_max_logit_clipped",
        "steps_above_tau",
        "clipped_heads_total",
        "qk_clip_ever_frac",
        "final_val_loss",
    )
    return {key: run[key] for key in keys}


def equal_token_losses(best: dict[str, dict[str, Any]], points: int = 4) -> dict[str, Any]:
    """Validation loss of each best run at up to ``points`` evaluation points shared by all, evenly spread."""
    shared = sorted(set.intersection(*(set(p["tokens"] for p in run["val_curve"]) for run in best.values())))
    if not shared:
        return {"tokens": [], "val_loss": {}}
    picks = sorted({shared[round(i * (len(shared) - 1) / max(points - 1, 1))] for i in range(points)})
    losses = {
        name: [next(p["val_loss"] for p in run["val_curve"] if p["tokens"] == t) for t in picks]
        for name, run in best.items()
    }
    return {"tokens": picks, "val_loss": losses}


# ---- outputs ---------------------------------------------------------------------------------------------
def _tokens(value: float | None) -> str:
    if value is None:
        return "not reached"
    return f"{value / 1e3:,.0f}k" if value >= 1e4 else f"{value:,.0f}"


def markdown_report(results: dict[str, Any]) -> str:
    """The tables of ``ablation.md``."""
    s = results["settings"]
    lines = [
        f"# Optimizer ablation: {s['preset']}, {s['steps']} steps × {s['tokens_per_step']:,} tokens "
        f"({s['tokens']:,} tokens)",
        "",
        f"Same data order, same initial weights (seed {s['seed']}), same evaluation batches for every run; "
        f"data: {s['data']}; precision {s['precision']}; schedule {s['schedule']['kind']} "
        f"(warmup {s['schedule'].get('warmup_steps')}, decay fraction {s['schedule'].get('decay_fraction')}); "
        f"validation every {s['eval_every']} steps on {s['eval_batches']} batches; Muon lr "
        f"`{s['adjust_lr_fn']}`, weight decay {s['weight_decay']}; MuonClip τ = {s['tau']:g}.",
        "",
        "## Learning-rate sweep (final validation loss)",
        "",
        *md_table(["optimizer", *(f"lr {lr:g}" for lr in s["lrs"]), "best lr"], _sweep_rows(results)),
    ]
    equal = results["equal_tokens"]
    lines += ["", "## Validation loss at equal tokens (best lr of each optimizer)", ""]
    lines += md_table(
        ["optimizer", *(f"{_tokens(t)} tokens" for t in equal["tokens"])],
        [[LABELS[name], *(fmt(v) for v in losses)] for name, losses in equal["val_loss"].items()],
    )
    reference = results["reference"]
    lines += [
        "",
        f"## Tokens to reach validation loss {fmt(results['target_loss'])} ({results['target_rule']})",
        "",
    ]
    header = ["optimizer", "lr", "final val loss", "tokens to target", f"token efficiency vs {LABELS[reference]}",
              "peak max logit", "heads ever clipped", "median tokens/s"]  # fmt: skip
    rows = []
    for name, row in results["comparison"].items():
        efficiency = row["token_efficiency_vs_" + reference]
        rows.append([
            LABELS[name], f"{row['lr']:g}", fmt(row["final_val_loss"]), _tokens(row["tokens_to_target"]),
            f"{fmt(efficiency, '.2f')}{'×' if efficiency else ''}", fmt(row["peak_max_logit"], ".2f"),
            f"{row['qk_clip_ever_frac']:.0%}", fmt(row["median_tokens_per_s"], ",.0f"),
        ])  # fmt: skip
    lines += md_table(header, rows)
    if results["stress"]:
        lines += _stress_markdown(results["stress"])
    runs = len(results["runs"]) + len(results["stress_runs"])
    lines += ["", timing_note(results, runs), ""]
    return "\n".join(lines)


def _sweep_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per optimizer: its final validation loss at every lr of the grid, and its best lr."""
    rows = []
    for name in results["best"]:
        cells = []
        for lr in results["settings"]["lrs"]:
            run = next((r for r in results["runs"] if r["optimizer"] == name and r["lr"] == lr), None)
            cells.append(fmt(run["final_val_loss"]) if run else "—")
        rows.append([LABELS[name], *cells, f"{results['comparison'][name]['lr']:g}"])
    return rows


def _stress_rows(stress: dict[str, Any], markdown: bool) -> list[list[str]]:
    """The stress table's cells (the markdown table has two more columns than the console's)."""
    rows = []
    for name, row in stress["runs"].items():
        cells = [LABELS[name], fmt(row["peak_max_logit"], ".2f"), fmt(row["peak_max_logit_clipped"], ".2f"),
                 str(row["steps_above_tau"])]  # fmt: skip
        if markdown:
            cells += [f"{row['clipped_heads_total']:.0f}", f"{row['qk_clip_ever_frac']:.0%}"]
        rows.append([*cells, fmt(row["final_val_loss"])])
    return rows


def _stress_markdown(stress: dict[str, Any]) -> list[str]:
    header = ["optimizer", "peak max logit", "peak after clip", "steps with max logit > τ", "clipped head-steps",
              "heads ever clipped", "final val loss"]  # fmt: skip
    verdict = (
        "Muon's max logit ran past τ while MuonClip kept every head at or below τ after each step."
        if stress["demonstrated"]
        else "Not demonstrated in this setting: "
        + ("Muon stayed at or below τ." if not stress["muon_exceeds_tau"] else "MuonClip exceeded τ.")
    )
    return [
        "",
        f"## Stress: lr {stress['lr']:g}, τ = {stress['tau']:g}, {stress['steps']} steps",
        "",
        "`max logit` is the largest per-head attention logit S_max of a step's forward, before that step's "
        "clip; `after clip` is the same batch's maximum after QK-Clip rescaled the heads (`max_logit_clipped`).",
        "",
        *md_table(header, _stress_rows(stress, markdown=True)),
        "",
        f"**{verdict}**",
    ]


def plot_ablation(results: dict[str, Any], target: Path) -> Path:
    """``ablation.png``: val loss vs tokens, final val loss vs lr, max logit vs step (sweep and stress)."""
    figure = new_figure((13, 9))
    axes = figure.subplots(2, 2)
    s = results["settings"]
    figure.suptitle(
        f"Optimizer ablation: {s['preset']}, {s['tokens']:,} tokens, same data and init", fontsize=14
    )
    _val_curves(axes[0, 0], results)
    _lr_sweep(axes[0, 1], results)
    _best_max_logits(axes[1, 0], results)
    _stress_panel(axes[1, 1], results)
    return save_figure_atomically(figure, target)


def _val_curves(ax: Any, results: dict[str, Any]) -> None:
    """Validation loss vs tokens of every sweep run, the best lr of each optimizer bold."""
    best_names = set(results["best"].values())
    for run in results["runs"]:
        curve = run["val_curve"]
        if not curve:
            continue
        is_best = run["name"] in best_names
        ax.plot(
            [p["tokens"] for p in curve],
            [p["val_loss"] for p in curve],
            color=COLORS[run["optimizer"]],
            linewidth=2 if is_best else 0.8,
            alpha=1.0 if is_best else 0.35,
            linestyle=STYLES[run["optimizer"]] if is_best else ":",
            marker="o" if is_best else None,
            markersize=3,
            label=f"{LABELS[run['optimizer']]} lr {run['lr']:g}" if is_best else None,
        )
    if math.isfinite(results["target_loss"]):
        ax.axhline(results["target_loss"], color="grey", linestyle=":", label="target")
    finals = [r["final_val_loss"] for r in results["runs"] if math.isfinite(r["final_val_loss"])]
    if finals:
        firsts = [r["val_curve"][0]["val_loss"] for r in results["runs"] if r["val_curve"]]
        top = min(max(v for v in firsts if math.isfinite(v)), min(finals) + 3.0) if firsts else None
        ax.set_ylim(min(finals) - 0.1, top)
    ax.set_title("validation loss vs tokens (best lr bold, other lrs dotted)")
    finish_axes(ax, "training tokens", "validation loss (nats/token)")


def _lr_sweep(ax: Any, results: dict[str, Any]) -> None:
    """Final validation loss vs lr, one line per optimizer."""
    for name in results["best"]:
        runs = sorted((r for r in results["runs"] if r["optimizer"] == name), key=lambda r: r["lr"])
        ax.plot(
            [r["lr"] for r in runs],
            [r["final_val_loss"] for r in runs],
            marker="o",
            color=COLORS[name],
            linestyle=STYLES[name],
            label=LABELS[name],
        )
    ax.set_xscale("log")
    ax.set_title("learning-rate sweep")
    finish_axes(ax, "peak learning rate", "final validation loss")


def _best_max_logits(ax: Any, results: dict[str, Any]) -> None:
    """Max attention logit vs step of each optimizer's best run, with the sweep's τ."""
    best_names, tau = set(results["best"].values()), results["settings"]["tau"]
    for run in results["runs"]:
        if run["name"] in best_names:
            steps = range(1, len(run["max_logit"]) + 1)
            name = run["optimizer"]
            ax.plot(steps, run["max_logit"], color=COLORS[name], linestyle=STYLES[name], label=LABELS[name])
    ax.axhline(tau, color="red", linestyle="--", label=f"τ = {tau:g}")
    ax.set_yscale("log")
    ax.set_title("max logit vs step (best lr of each)")
    finish_axes(ax, "step", "max attention logit (all layers, heads)", which="both")


def _stress_panel(ax: Any, results: dict[str, Any]) -> None:
    """Max logit vs step of the stress runs (MuonClip also after its clip), or a note without them."""
    stress = results["stress"]
    if stress:
        for run in results["stress_runs"]:
            steps = range(1, len(run["max_logit"]) + 1)
            color = COLORS[run["optimizer"]]
            ax.plot(steps, run["max_logit"], color=color, label=f"{LABELS[run['optimizer']]} max logit")
            if run["optimizer"] == "muonclip":
                ax.plot(
                    steps, run["max_logit_clipped"], color=color, linestyle=":", label="MuonClip after clip"
                )
        ax.axhline(stress["tau"], color="red", linestyle="--", label=f"τ = {stress['tau']:g}")
        ax.set_title(f"stress: lr {stress['lr']:g}, τ = {stress['tau']:g}")
    else:
        ax.text(0.5, 0.5, "no stress run", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("stress")
    finish_axes(ax, "step", "max attention logit", legend=bool(stress))


def print_summary(results: dict[str, Any], console: Console) -> None:
    """Rich tables of the comparison and the stress setting."""
    reference = results["reference"]
    rows = []
    for name, row in results["comparison"].items():
        efficiency = row["token_efficiency_vs_" + reference]
        rows.append([
            LABELS[name], f"{row['lr']:g}", fmt(row["final_val_loss"]), _tokens(row["tokens_to_target"]),
            f"{fmt(efficiency, '.2f')}×" if efficiency else "—", fmt(row["peak_max_logit"], ".2f"),
        ])  # fmt: skip
    header = [
        "optimizer",
        "lr",
        "final val loss",
        "tokens to target",
        f"vs {LABELS[reference]}",
        "peak max logit",
    ]
    title = (
        f"best lr of each optimizer; target val loss {fmt(results['target_loss'])} ({results['target_rule']})"
    )
    console.print(rich_table(title, header, rows))
    stress = results["stress"]
    if stress:
        header = ["optimizer", "peak max logit", "peak after clip", "steps > τ", "final val loss"]
        title = f"stress: lr {stress['lr']:g}, τ {stress['tau']:g}"
        console.print(rich_table(title, header, _stress_rows(stress, markdown=False)))
        style = "green" if stress["demonstrated"] else "yellow"
        console.print(
            f"[{style}]QK-Clip {'demonstrated' if stress['demonstrated'] else 'NOT demonstrated'}:[/] "
            f"Muon above τ: {stress['muon_exceeds_tau']}, MuonClip after clip ≤ τ: "
            f"{stress['muonclip_clipped_within_tau']}"
        )


REPORT = Report("ablation", markdown_report, plot_ablation, print_summary)
