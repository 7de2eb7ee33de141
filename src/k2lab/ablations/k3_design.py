"""K3's architecture claims at small scale: AttnRes, Stable LatentMoE and hybrid KDA + MLA on the same tokens.

Every arm is one ``run_training`` call of the same recipe (the K3 preset) with a few model fields overridden
(``ARMS``) and its own run directory, so data order, lr, schedule, batch and evaluation batches are the
same; the seed is the same too, so parameters the arms share start from the same draw wherever their
shapes and creation order agree (the arms are different models, so their step-1 losses may differ).

    k3              the preset as it is: Block AttnRes, SiTU-GLU + latent RMSNorm, KDA + periodic NoPE MLA
    no-attnres      attnres_block_size = None: a standard residual stream   (Design 5, the depth axis)
    swiglu-no-norm  mlp_activation = swiglu, moe_latent_norm = False: the unstable LatentMoE (Design 6)
    all-mla         mla_layers = None, mla_rope = True: every layer global MLA with RoPE (Design 5, the
                    sequence axis; with no KDA layer to carry position, a NoPE-only model would have none)

Per arm, from its ``metrics.jsonl``: the validation loss curve at equal tokens; the median per-step
training throughput; the parameters (total and active per token, ``k2lab.params``); the maxima the trainer
measures on the validation batches at each evaluation (``k2lab.train.moe_telemetry``): max |u| of the routed
sum (the latent u = Σ p_i E_i(W_down x) before RMSNorm / W_up) and max |y| of the MoE output, over the MoE
layers; and the gradient norm (before clipping): its maximum and the spikes, steps whose norm exceeds
``spike_factor`` × the median of the ``spike_window`` steps before it.

Outputs, for an output directory ``DIR``: ``DIR/k3_design.md`` (table and one verdict per claim),
``DIR/k3_design.json`` (everything, with the curves) and ``DIR/k3_design.png`` (validation loss, latent
max |u| and gradient norm vs step per arm). Runs live in ``DIR/runs/{arm}`` and are reused when the command
is repeated (``k2lab.ablations.common``).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, NamedTuple

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
from k2lab.fsutil import save_figure_atomically
from k2lab.params import count_parameters, humanize
from k2lab.presets import language_model_config
from k2lab.train.config import TrainConfig
from k2lab.train.metrics import read_metrics
from k2lab.train.moe_telemetry import OUTPUT_KEY, ROUTED_KEY


class Arm(NamedTuple):
    """One arm: its label in the report, its model overrides and its plot colour."""

    label: str
    overrides: dict[str, Any]
    color: str


ARMS: dict[str, Arm] = {
    "k3": Arm("K3 (preset)", {}, "tab:red"),
    "no-attnres": Arm("plain residuals", {"attnres_block_size": None}, "tab:blue"),
    "swiglu-no-norm": Arm(
        "SwiGLU, no latent norm", {"mlp_activation": "swiglu", "moe_latent_norm": False}, "tab:orange"
    ),
    "all-mla": Arm("all MLA (RoPE)", {"mla_layers": None, "mla_rope": True}, "tab:green"),
}
REFERENCE = "k3"  # the arm the others are compared with

# k3-mini on the embedded corpus: 4 arms × 120 steps × 8×256 tokens as 2 one-thread worker processes, two
# arms at a time: 9.2 min wall (17.5 CPU-min) on a Zen 4's 2 free cores at seeds 0 and 1 (session 59).
DEFAULT_RECIPE: dict[str, Any] = {
    "preset": "k3-mini",
    "steps": 120,
    "batch_size": 8,
    "seq_len": 256,
    "eval_batches": 4,
    "sample_tokens": 0,
    "schedule": {"kind": "wsd", "warmup_steps": 12, "decay_fraction": 0.2, "min_lr_ratio": 0.1},
}


class K3DesignConfig(AblationSettings):
    """What to run: a base recipe (the K3 model and everything but the arms' overrides), the arms, and how
    gradient-norm spikes are counted.

    ``jobs`` defaults to two worker processes (one per arm when fewer), each with ``threads`` torch threads
    (default: this process's threads divided among the jobs, at least one).
    """

    TEXT_ONLY = True
    BASE = DEFAULT_RECIPE
    EVAL_POINTS = 10  # the validation curve and the latent maxima are measured at every evaluation
    WHAT = "k3-design ablation setting"

    arms: list[str] = Field(
        default_factory=lambda: list(ARMS), description=f"Arms compared (of {', '.join(ARMS)})"
    )
    spike_factor: float = Field(
        default=2.0, gt=1, description="A step's grad norm is a spike above this × the trailing median"
    )
    spike_window: int = Field(default=10, gt=0, description="Steps of the trailing median of the spike test")
    jobs: int | None = Field(
        default=None, gt=0, description="Runs trained at once, in worker processes (unset: 2, or 1 for 1 arm)"
    )
    out: str = Field(default="runs/k3-design", description="Output directory")

    @field_validator("arms")
    @classmethod
    def _known_arms(cls, names: list[str]) -> list[str]:
        return ordered_subset(names, tuple(ARMS), "arms")

    @model_validator(mode="after")
    def _resolve_jobs(self) -> K3DesignConfig:
        if self.jobs is None:
            self.jobs = min(2, len(self.arms))
        return self


def arm_overrides(base: TrainConfig, arm: str) -> dict[str, Any]:
    """The model overrides of ``arm``: the recipe's own, then the arm's."""
    return {**base.model_overrides, **ARMS[arm].overrides}


def train_config(ablation: K3DesignConfig, arm: str) -> TrainConfig:
    """The base recipe with ``arm``'s model overrides, trained in ``OUT/runs/{arm}``."""
    base = ablation.base
    return with_updates(
        base, model_overrides=arm_overrides(base, arm), out=str(Path(ablation.out) / "runs" / arm)
    )


# ---- analysis --------------------------------------------------------------------------------------------
def grad_spikes(norms: list[float], factor: float, window: int) -> list[int]:
    """Indices t ≥ ``window`` with ``norms[t] > factor · median(norms[t-window:t])`` (non-finite: a spike)."""
    return [
        t
        for t in range(window, len(norms))
        if not math.isfinite(norms[t]) or norms[t] > factor * statistics.median(norms[t - window : t])
    ]


def activation_curve(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per evaluation: the step, max |u| of the routed sum and max |y| of the MoE output over the layers."""

    def layer_max(record: dict[str, Any], prefix: str) -> float:
        values = [v for k, v in record.items() if k.startswith(prefix + "/layer")]
        return max(values) if values else math.nan

    return [
        {"step": r["step"], "routed_max": layer_max(r, ROUTED_KEY), "out_max": layer_max(r, OUTPUT_KEY)}
        for r in records
        if "val_loss" in r
    ]


def parameter_counts(config: TrainConfig) -> dict[str, int]:
    """Total and per-token active parameters of a run's model (the recipe's vocabulary when it sets one)."""
    vocab = {"vocab_size": config.vocab_size} if config.vocab_size else {}
    report = count_parameters(language_model_config(config.preset, **vocab, **config.model_overrides))
    return {
        "total": report.total,
        "active": report.active,
        "total_excl_embeddings": report.total_excl_embeddings,
        "active_excl_embeddings": report.active_excl_embeddings,
    }


def summarize_run(
    ablation: K3DesignConfig, arm: str, config: TrainConfig, summary: dict, reused: bool
) -> dict[str, Any]:
    """One arm's figures and curves from its ``metrics.jsonl``."""
    records = read_metrics(config.out)
    val = val_points(records)
    norms = [float(r["grad_norm"]) for r in records]
    spikes = grad_spikes(norms, ablation.spike_factor, ablation.spike_window)
    activations = activation_curve(records)
    routed = [p["routed_max"] for p in activations]
    throughput = [float(r["tokens_per_s"]) for r in records[1:]] or [math.nan]  # step 1 warms up
    return {
        "arm": arm,
        "overrides": ARMS[arm].overrides,
        "run_dir": str(config.out),
        "steps": len(records),
        "tokens": len(records) * tokens_per_step(config),
        "params": parameter_counts(config),
        "first_loss": float(records[0]["loss"]),
        "final_val_loss": val[-1][1] if val else math.nan,
        "val_curve": [{"step": s, "val_loss": v} for s, v in val],
        "loss": [float(r["loss"]) for r in records],
        "tokens_per_s": statistics.median(throughput),
        "grad_norm": norms,
        "grad_norm_max": max(norms, default=math.nan),
        "spike_steps": [t + 1 for t in spikes],
        "activations": activations,
        "routed_max_final": routed[-1] if routed else math.nan,
        "routed_max_peak": max(routed, default=math.nan),
        "out_max_peak": max((p["out_max"] for p in activations), default=math.nan),
        "diverged": summary.get("diverged"),
        **run_times(summary, reused),
    }


def run_k3_design(ablation: K3DesignConfig, console: Console | None = None) -> dict[str, Any]:
    """Train every arm (or reuse it), analyse, write DIR/k3_design.{json,md,png}; returns the results."""
    study = StudyRun(ablation, console or Console())
    configs = [train_config(ablation, arm) for arm in ablation.arms]
    plan = [
        PlannedRun(config, f"{ARMS[arm].label}, {config.steps} steps → {config.out}", arm)
        for arm, config in zip(ablation.arms, configs, strict=True)
    ]

    def describe(index: int, summary: dict) -> str:
        return f"{ARMS[ablation.arms[index]].label}: final val loss {summary.get('val_loss', math.nan):.4f}"

    outcomes = study.train(plan, describe)
    runs = [
        summarize_run(ablation, arm, config, summary, reused)
        for arm, config, (summary, reused) in zip(ablation.arms, configs, outcomes, strict=True)
    ]
    return study.finish(analyse(ablation, runs), runs, REPORT)


def analyse(ablation: K3DesignConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Settings, the runs, the fairness check (same tokens) and the verdicts."""
    base = ablation.base
    results = {
        "settings": {
            **recipe_settings(base),
            "optimizer": base.optimizer.name,
            "lr": base.optimizer.lr,
            "grad_clip": base.grad_clip,
            "arms": ablation.arms,
            "spike_factor": ablation.spike_factor,
            "spike_window": ablation.spike_window,
        },
        "runs": runs,
        "same_tokens": len({run["tokens"] for run in runs}) == 1,
    }
    results["verdicts"] = verdicts(results)
    return results


# ---- verdicts --------------------------------------------------------------------------------------------
CAVEAT = "one seed and no run-to-run spread measured, so a small difference is not significant"


def _loss_phrase(run: dict[str, Any], other: dict[str, Any]) -> str:
    delta = run["final_val_loss"] - other["final_val_loss"]
    direction = "lower" if delta < 0 else "higher" if delta > 0 else "equal"
    return (
        f"final validation loss {fmt(run['final_val_loss'], '.4f')} vs {fmt(other['final_val_loss'], '.4f')} "
        f"({direction} by {fmt(abs(delta), '.4f')} nats)"
    )


def _size_phrase(ratio: float) -> str:
    if not math.isfinite(ratio):
        return "unmeasured"
    return "larger" if ratio > 1 else "no larger"


def verdicts(results: dict[str, Any]) -> dict[str, str]:
    """One sentence per claim whose two arms both ran, stating what was measured."""
    by_arm = {run["arm"]: run for run in results["runs"]}
    k3, tokens = by_arm.get(REFERENCE), f"{results['settings']['tokens']:,}"
    if k3 is None:
        return {}
    out: dict[str, str] = {}
    if (plain := by_arm.get("no-attnres")) is not None:
        out["attnres"] = (
            f"AttnRes (Design 5, depth): at {tokens} tokens Block AttnRes had a {_loss_phrase(k3, plain)} "
            "against a standard residual stream; this measures the loss only, not whether layers retrieve "
            f"older representations selectively ({CAVEAT})."
        )
    if (unstable := by_arm.get("swiglu-no-norm")) is not None:
        ratio = unstable["routed_max_peak"] / k3["routed_max_peak"]
        out["stable_latent_moe"] = (
            f"Stable LatentMoE (Design 6): the largest latent routed sum |u| on the validation batches was "
            f"{fmt(k3['routed_max_peak'], '.3g')} with SiTU-GLU + RMSNorm vs "
            f"{fmt(unstable['routed_max_peak'], '.3g')} with SwiGLU and no norm (×{fmt(ratio, '.2f')}), the "
            f"MoE output peaked at {fmt(k3['out_max_peak'], '.3g')} vs "
            f"{fmt(unstable['out_max_peak'], '.3g')}, "
            f"grad-norm spikes {len(k3['spike_steps'])} vs {len(unstable['spike_steps'])}, "
            f"{_loss_phrase(k3, unstable)}; at this scale and lr this shows {_size_phrase(ratio)} latent "
            "activations without the stabilisers, not the explosion the spec describes at K3's size "
            f"({CAVEAT})."
        )
    if (dense := by_arm.get("all-mla")) is not None:
        out["hybrid"] = (
            f"Hybrid KDA + gated NoPE MLA (Design 5, sequence): at {tokens} tokens of "
            f"{results['settings']['seq_len']}-token rows the hybrid had a {_loss_phrase(k3, dense)} against "
            f"every layer MLA with RoPE, at {fmt(k3['tokens_per_s'], ',.0f')} vs "
            f"{fmt(dense['tokens_per_s'], ',.0f')} training tokens/s; the long-context cost the hybrid is "
            "for (a fixed-size state instead of a growing KV cache) is not exercised at this length "
            f"({CAVEAT})."
        )
    return out


# ---- outputs ---------------------------------------------------------------------------------------------
TABLE_HEADER = [
    "arm",
    "overrides",
    "params total / active",
    "final val loss",
    "Δ vs K3",
    "tokens/s",
    "latent ‖u‖∞ last eval",
    "latent ‖u‖∞ peak",
    "MoE ‖y‖∞ peak",
    "max grad norm",
    "grad-norm spikes",
]  # ‖·‖∞: the largest |value| (no "|" inside a markdown table cell)


def _overrides(run: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in run["overrides"].items()) or "(preset)"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """The comparison table's cells, one row per arm (shared by the markdown and the console table)."""
    k3 = next((run for run in results["runs"] if run["arm"] == REFERENCE), None)
    rows = []
    for run in results["runs"]:
        params = run["params"]
        reference = k3 is None or run is k3
        delta = math.nan if reference else run["final_val_loss"] - k3["final_val_loss"]
        rows.append(
            [
                ARMS[run["arm"]].label,
                _overrides(run),
                f"{humanize(params['total'])} / {humanize(params['active'])}",
                fmt(run["final_val_loss"], ".4f"),
                fmt(delta, "+.4f"),
                fmt(run["tokens_per_s"], ",.0f"),
                fmt(run["routed_max_final"], ".3g"),
                fmt(run["routed_max_peak"], ".3g"),
                fmt(run["out_max_peak"], ".3g"),
                fmt(run["grad_norm_max"], ".3g"),
                str(len(run["spike_steps"])),
            ]
        )
    return rows


def markdown_report(results: dict[str, Any]) -> str:
    """The table and the verdicts of ``k3_design.md``."""
    s = results["settings"]
    fair = "equal" if results["same_tokens"] else "NOT equal (the arms are not comparable)"
    lines = [
        f"# K3 design ablation: {s['preset']}, {s['steps']} steps × {s['tokens_per_step']:,} tokens "
        f"({s['tokens']:,} tokens per arm)",
        "",
        f"Same seed ({s['seed']}), data order, lr ({s['optimizer']} {s['lr']:g}, schedule "
        f"{s['schedule']['kind']}), batch and evaluation batches ({s['eval_batches']} every "
        f"{s['eval_every']} steps) for every arm; tokens per arm {fair}. Data: {s['data']}; precision {s['precision']}. "
        "Each arm is the preset with the listed model fields overridden.",
        "",
        "Columns: parameters total and active per token (embeddings included); the final validation loss and "
        "its difference to K3; the median training tokens/s of steps 2.. (runs trained side by side share "
        "the CPU); ‖u‖∞ = max |u| of the latent routed sum u before the RMSNorm / W_up and ‖y‖∞ = max |y| of "
        "the MoE output, over the MoE layers and the validation batches, at the last evaluation and the peak "
        "over all evaluations; the largest "
        f"gradient norm (before clipping at {s['grad_clip']:g}); spikes are steps whose grad norm exceeds "
        f"{s['spike_factor']:g} × the median of the {s['spike_window']} steps before.",
        "",
        *md_table(TABLE_HEADER, table_rows(results)),
        "",
        "## Verdicts",
        "",
        *(f"- {sentence}" for sentence in results["verdicts"].values()),
        *([] if results["verdicts"] else ["- (a verdict compares an arm with the k3 arm: run it too)"]),
        "",
        timing_note(results, len(results["runs"])),
        "",
    ]
    return "\n".join(lines)


def plot_k3_design(results: dict[str, Any], target: Path) -> Path:
    """``k3_design.png``: validation loss, latent max |u| and gradient norm vs step, one colour per arm."""
    s = results["settings"]
    figure = new_figure((16, 5))
    figure.suptitle(
        f"K3 design ablation: {s['preset']}, {s['tokens']:,} tokens per arm, same data and seed", fontsize=13
    )
    loss_ax, latent_ax, grad_ax = figure.subplots(1, 3)
    for run in results["runs"]:
        arm = ARMS[run["arm"]]
        plot_val_curve(loss_ax, run["val_curve"], color=arm.color, label=arm.label)
        points = [p for p in run["activations"] if math.isfinite(p["routed_max"])]
        latent_ax.plot(
            [p["step"] for p in points], [p["routed_max"] for p in points], marker="o", color=arm.color,
            label=arm.label,
        )  # fmt: skip
        grad_ax.plot(
            range(1, run["steps"] + 1), run["grad_norm"], color=arm.color, linewidth=1, label=arm.label
        )
        spikes = run["spike_steps"]
        grad_ax.scatter(spikes, [run["grad_norm"][t - 1] for t in spikes], color=arm.color, marker="x")
    loss_ax.set_title("validation loss (same evaluation batches)", fontsize=10)
    latent_ax.set_title("max |u|, latent routed sum before norm / W_up\n(validation batches)", fontsize=10)
    grad_ax.set_title(
        f"gradient norm before clipping (×: spikes > {s['spike_factor']:g}× median)", fontsize=10
    )
    latent_ax.set_yscale("log")
    grad_ax.set_yscale("log")
    finish_axes(loss_ax, "step", "nats/token")
    finish_axes(latent_ax, "step", "max |u|")
    finish_axes(grad_ax, "step", "grad norm")
    return save_figure_atomically(figure, target)


def print_summary(results: dict[str, Any], console: Console) -> None:
    """The comparison as a rich table, then the verdicts."""
    s = results["settings"]
    title = f"K3 design arms: {s['preset']}, {s['steps']} steps × {s['tokens_per_step']:,} tokens"
    rows = [row[:1] + row[2:] for row in table_rows(results)]  # the overrides are in the markdown
    console.print(rich_table(title, TABLE_HEADER[:1] + TABLE_HEADER[2:], rows))
    for sentence in results["verdicts"].values():
        console.print(f"- {sentence}", markup=False)
    if not results["same_tokens"]:
        console.print("[yellow]warning:[/] the arms trained on different numbers of tokens")


REPORT = Report("k3_design", markdown_report, plot_k3_design, print_summary)
