"""``k2lab ablate parl``: PARL's reward terms, ablated on wide tasks with the compact orchestrator.

Arms (same tasks, seeds and sampling seeds; ``ParlConfig`` otherwise equal):

* ``full``          r = λ1·r_parallel + λ2·r_finish + r_perf, λ1, λ2 annealed linearly to 0
* ``no_parallel``   λ1 = 0 (serial collapse expected: the single-agent start rarely leaves working alone)
* ``no_finish``     λ2 = 0 (spurious fan-out expected: sub-agents farmed for r_parallel, tasks unfinished)
* ``single_agent``  no sub-agent tools at all (the orchestrator can only query shards itself)

The orchestrator is the **compact path** (``CompactOrchestrator``: a factorised categorical policy over
orchestration actions starting from a single-agent prior) and the sub-agents are the procedural frozen
``ShardWorker``; the language-model path is exercised by the tests only (a tiny random model learns nothing
in minutes).

Reported per arm (mean over seeds, held-out tasks, greedy policy, after training): success, success on
wide tasks (≥ B_main shards, serially impossible), CriticalSteps and its speed-up over the serial reference
(a single agent without a turn budget, which needs n + 1 steps), total tokens (orchestrator + sub-agents)
and their ratio to the serial reference (the cost of the speed-up), tool calls, sub-agents,
unfinished subtasks; during training: sub-agents and unfinished subtasks per episode; the training
iterations until held-out success first reaches ``target`` (time to target), and the training seconds.
Each run lives in ``OUT/runs/ARM/seedS`` and resumes (or is reused when finished) on a repeated command.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from rich.console import Console

from k2lab.ablations.common import check_run_directory, make_output_directory, ordered_subset
from k2lab.ablations.report import Report, fmt, new_figure
from k2lab.fsutil import atomic_write_text, make_directory, save_figure_atomically
from k2lab.swarm.parl import CompactOrchestrator, ParlConfig, ParlTrainer, evaluate, make_env
from k2lab.swarm.tasks import split_seeds

__all__ = ["ARMS", "QUICK", "ParlAblationSettings", "run_parl_ablation"]

ARMS: dict[str, dict[str, Any]] = {
    "full": {},
    "no_parallel": {"lambda_parallel": 0.0},
    "no_finish": {"lambda_finish": 0.0},
    "single_agent": {"single_agent": True, "lambda_parallel": 0.0, "lambda_finish": 0.0},
}
PARL_MARKER = "parl_config.json"  # a run of this study: the ParlConfig it trains (resumed when unchanged)
EVAL_KEYS = (
    "success",
    "wide_success",
    "critical_steps",
    "total_tokens",
    "tool_calls",
    "subagents",
    "unfinished",
)


# ``--quick``: a smoke run (4 iterations, 1 seed, 8 tasks), as an overlay of the settings applied before the
# recipe, ``--set`` and the options.
QUICK: dict[str, Any] = {"base": {"iterations": 4, "eval_tasks": 8, "group_size": 4}, "seeds": [0]}


class ParlAblationSettings(BaseModel):
    """What ``k2lab ablate parl`` runs: the shared ``ParlConfig``, arms, seeds, target and output folder."""

    model_config = ConfigDict(extra="forbid")

    WHAT: ClassVar[str] = "PARL ablation setting"

    out: str = Field(default="runs/parl", description="Output directory")
    base: ParlConfig = Field(default_factory=ParlConfig)
    arms: list[str] = Field(
        default_factory=lambda: list(ARMS), description="Arms (of full, no_parallel, no_finish, single_agent)"
    )
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], description="Seeds (tasks, sampling)")
    target: float = Field(default=0.9, gt=0, le=1, description="Held-out success for 'time to target'")
    threads: int = Field(default=1, ge=1, description="torch threads")

    @field_validator("arms")
    @classmethod
    def _known_arms(cls, arms: list[str]) -> list[str]:
        return ordered_subset(arms, tuple(ARMS), "arms")

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be one or more distinct seeds, got {seeds}")
        return seeds


def run_parl_ablation(settings: ParlAblationSettings, console: Console | None = None) -> dict[str, Any]:
    """Train (or reuse) every arm × seed, write OUT/parl.{md,json,png}; returns the results."""
    console = console or Console()
    arms = ordered_subset(settings.arms, tuple(ARMS), "arms")
    out, start, available = make_output_directory(settings.out), time.perf_counter(), torch.get_num_threads()
    for arm in arms:  # before training anything: a directory the study may not replace
        for seed in settings.seeds:
            check_run_directory(_run_dir(out, arm, seed), PARL_MARKER)
    torch.set_num_threads(settings.threads)
    try:
        runs = {arm: [_run_arm(settings, arm, seed, out, console) for seed in settings.seeds] for arm in arms}
    finally:
        torch.set_num_threads(available)
    results = {
        "settings": settings.model_dump(mode="json"),
        "serial_reference": serial_reference(settings),
        "arms": {arm: _summarise(rows, settings) for arm, rows in runs.items()},
        "curves": {arm: _curve(rows) for arm, rows in runs.items()},
        "wall_seconds": round(time.perf_counter() - start, 2),
    }
    _relative(results["arms"], results["serial_reference"])
    return REPORT.write(results, out, console)


def _run_arm(settings: ParlAblationSettings, arm: str, seed: int, out: Path, console: Console) -> list[dict]:
    config = ParlConfig.model_validate({**settings.base.model_dump(), **ARMS[arm], "seed": seed})
    run_dir = _run_dir(out, arm, seed)
    marker = run_dir / PARL_MARKER
    recipe = json.dumps(config.model_dump(mode="json"), sort_keys=True)
    if run_dir.exists() and (not marker.is_file() or marker.read_text() != recipe):
        check_run_directory(run_dir, PARL_MARKER)  # a run of the study (or empty), never anything else
        shutil.rmtree(run_dir)  # a different recipe: the directory belongs to the ablation
    make_directory(run_dir, "the run directory")
    atomic_write_text(marker, recipe)
    trainer = ParlTrainer(CompactOrchestrator.from_config(config), make_env(config), config, run_dir)
    console.print(
        f"[{arm} seed {seed}] from iteration {trainer.iteration}/{config.iterations}",
        highlight=False,
        markup=False,
    )
    trainer.run()
    return trainer.history()


def _run_dir(out: Path, arm: str, seed: int) -> Path:
    """Where one arm × seed trains: ``OUT/runs/ARM/seedS``."""
    return out / "runs" / arm / f"seed{seed}"


def _summarise(rows: list[list[dict]], settings: ParlAblationSettings) -> dict[str, Any]:
    """Means over seeds of the final held-out eval, training fan-out, and time to target."""
    base = settings.base
    finals = [[r for r in history if "eval" in r][-1]["eval"] for history in rows]
    summary: dict[str, Any] = {k: _mean([f[k] for f in finals]) for k in EVAL_KEYS}
    summary["train_subagents"] = _mean([_mean([r["subagents"] for r in h]) for h in rows])
    summary["train_unfinished"] = _mean([_mean([r["unfinished"] for r in h]) for h in rows])
    hits = [_time_to_target(h, settings.target) for h in rows]
    reached = [h for h in hits if h is not None]
    summary["iterations_to_target"] = _mean(reached)
    summary["episodes_to_target"] = _mean([h * base.groups_per_iteration * base.group_size for h in reached])
    summary["reached_target"] = f"{len(reached)}/{len(rows)}"
    summary["train_seconds"] = round(sum(r["seconds"] for h in rows for r in h), 2)
    return summary


def _time_to_target(history: list[dict], target: float) -> int | None:
    """Training iterations done when held-out success first reached ``target`` (None: never)."""
    return next((r["iteration"] + 1 for r in history if "eval" in r and r["eval"]["success"] >= target), None)


def _curve(rows: list[list[dict]]) -> dict[str, list]:
    """Per eval point: iterations done and the seed-mean held-out metrics; per iteration: training fan-out."""
    points = sorted({r["iteration"] + 1 for h in rows for r in h if "eval" in r})
    curve: dict[str, list] = {"eval_iterations": points}
    for key in ("success", "critical_steps", "total_tokens"):
        curve[key] = [_mean([r["eval"][key] for h in rows for r in h if "eval" in r and r["iteration"] + 1 == p])
                      for p in points]  # fmt: skip
    length = min(len(h) for h in rows)
    for key in ("unfinished", "subagents", "lambda_parallel"):
        curve[f"train_{key}"] = [_mean([h[i][key] for h in rows]) for i in range(length)]
    return curve


def serial_reference(settings: ParlAblationSettings) -> dict[str, Any]:
    """A single agent without a turn budget on the held-out tasks: it queries every shard itself and then
    answers, so it always succeeds in n + 1 CriticalSteps; the latency and cost reference of the table."""
    base = settings.base
    update = {**ARMS["single_agent"], "max_turns": base.max_shards + 1}
    config = ParlConfig.model_validate({**base.model_dump(), **update})
    orchestrator = CompactOrchestrator.from_config(config)
    rows = [
        evaluate(make_env(config), orchestrator, split_seeds("heldout", base.eval_tasks, s))
        for s in settings.seeds
    ]
    return {
        k: _mean([r[k] for r in rows]) for k in ("success", "critical_steps", "total_tokens", "tool_calls")
    }


def _relative(arms: dict[str, dict[str, Any]], serial: dict[str, Any]) -> None:
    """speed-up = CriticalSteps(serial reference) / CriticalSteps(arm); cost = tokens(arm) / tokens(serial)."""
    for summary in arms.values():
        summary["speedup_vs_serial"] = _ratio(serial["critical_steps"], summary["critical_steps"])
        summary["cost_vs_serial"] = _ratio(summary["total_tokens"], serial["total_tokens"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


# ------------------------------------------------------------------------------------------ outputs


def markdown(results: dict[str, Any]) -> str:
    """The report: one row per arm, then the settings."""
    s = results["settings"]
    head = (
        "| arm | held-out success | wide success | CriticalSteps | speed-up vs serial | total tokens | "
        "cost vs serial | tool calls | sub-agents | unfinished | train sub-agents | train unfinished | "
        f"iterations to {s['target']:.2f} (reached) | train s |\n" + "|---" * 14 + "|\n"
    )
    rows = "".join(
        f"| {arm} | {fmt(a['success'])} | {fmt(a['wide_success'])} | {fmt(a['critical_steps'], '.2f')} | "
        f"{fmt(a['speedup_vs_serial'], '.2f')}× | {fmt(a['total_tokens'], '.0f')} | "
        f"{fmt(a['cost_vs_serial'], '.2f')}× | {fmt(a['tool_calls'], '.1f')} | {fmt(a['subagents'], '.2f')} | "
        f"{fmt(a['unfinished'], '.2f')} | {fmt(a['train_subagents'], '.2f')} | "
        f"{fmt(a['train_unfinished'], '.2f')} | {fmt(a['iterations_to_target'], '.1f')} "
        f"({a['reached_target']}) | {fmt(a['train_seconds'], '.1f')} |\n"
        for arm, a in results["arms"].items()
    )
    b, r = s["base"], results["serial_reference"]
    reference = (
        f"| serial reference (no turn budget) | {fmt(r['success'])} | — | {fmt(r['critical_steps'], '.2f')} | "
        f"1.00× | {fmt(r['total_tokens'], '.0f')} | 1.00× | {fmt(r['tool_calls'], '.1f')} | 0 | 0 | — | — | — | — |\n"
    )
    note = (
        f"\nCompact orchestrator (factorised categorical policy over orchestration actions, single-agent prior "
        f"{b['solo_prior']}), procedural frozen sub-agents; seeds {s['seeds']}; {b['iterations']} iterations × "
        f"{b['groups_per_iteration']} groups × {b['group_size']} episodes; B_main = {b['max_turns']} turns, "
        f"{b['sub_max_steps']} steps per sub-agent, {b['min_shards']}–{b['max_shards']} shards; λ1(0) = "
        f"{b['lambda_parallel']}, λ2(0) = {b['lambda_finish']}, annealed linearly to 0 at "
        f"{b['anneal_fraction']:.0%} of training; {b['eval_tasks']} held-out tasks (greedy). Tokens: generated "
        "tokens of orchestrator and sub-agents (≈ characters / 4). Speed-up and cost are against a single agent "
        "without a turn budget (always correct, n + 1 steps); an arm that fails fast also looks 'fast': read "
        "them beside its success. "
        f"Wall time {results['wall_seconds']:.1f} s.\n"
    )
    return "# PARL ablation (k2lab ablate parl)\n\n" + head + rows + reference + note


def plot(results: dict[str, Any], path: Path) -> Path:
    """2×2 PNG: held-out success, CriticalSteps, total tokens over training; unfinished subtasks in training."""
    figure = new_figure((11, 7), layout=None)
    axes = figure.subplots(2, 2)
    panels = (("success", "held-out success"), ("critical_steps", "held-out CriticalSteps"),
              ("total_tokens", "held-out total tokens"), ("train_unfinished", "unfinished subtasks (training)"))  # fmt: skip
    for axis, (key, title) in zip(axes.flat, panels, strict=True):
        for arm, curve in results["curves"].items():
            xs = curve["eval_iterations"] if key in curve and not key.startswith("train_") else None
            ys = curve[key]
            xs = xs or list(range(1, len(ys) + 1))
            axis.plot(xs, ys, marker="o" if not key.startswith("train_") else None, markersize=3, label=arm)
        axis.set_title(title)
        axis.set_xlabel("training iteration")
    axes.flat[0].axhline(results["settings"]["target"], color="grey", linestyle=":", linewidth=1)
    axes.flat[0].legend(fontsize=8)
    figure.tight_layout()
    return save_figure_atomically(figure, Path(path), dpi=80)


def print_summary(results: dict[str, Any], console: Console) -> None:
    """The report itself, on the console."""
    console.print(markdown(results), highlight=False, soft_wrap=True)


REPORT = Report("parl", markdown, plot, print_summary)
