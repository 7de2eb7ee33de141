"""What every training study shares: its settings base, loading them, and training (or reusing) its runs.

A study is a list of ``TrainConfig`` that differ in one setting and in their run directory, so data order,
initial weights, schedule and evaluation batches are the same for every run. Its settings derive from
``AblationSettings``: ``base`` (the shared recipe) is merged over the study's ``BASE`` defaults, and
``load_settings`` reads a profile overlay (``--quick``), a recipe and dotted overrides into them.
``StudyRun`` trains the runs one after another in this process or in spawned worker processes
(``jobs > 1``), reusing every run directory that already holds a finished run of exactly the same recipe
(``ablation_run.json``), so an interrupted study continues where it stopped; then it records the times and
writes the report (``k2lab.ablations.report``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.console import Console

from k2lab.ablations.report import Report
from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text, make_directory
from k2lab.presets import get_preset
from k2lab.recipes import read_recipe, set_dotted, validate_config
from k2lab.train.config import TrainConfig
from k2lab.train.divergence import TrainingDiverged
from k2lab.train.metrics import read_metrics
from k2lab.train.run_directory import refuse_foreign
from k2lab.train.trainer import run_training

RUN_MARKER = "ablation_run.json"
Settings = TypeVar("Settings", bound=BaseModel)


# ---- settings --------------------------------------------------------------------------------------------
def merge_tables(into: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` written into ``into`` (nested tables merged, other values replaced); returns ``into``."""
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            merge_tables(into[key], value)
        else:
            into[key] = copy.deepcopy(value)
    return into


def study_base(defaults: Mapping[str, Any], base: Mapping[str, Any], eval_points: int) -> dict[str, Any]:
    """``base`` over the study's ``defaults``; ``eval_every`` defaults to ``steps // eval_points`` and
    checkpoints are written once, at the end."""
    data = merge_tables(copy.deepcopy(dict(defaults)), base)
    steps = int(data.get("steps", TrainConfig.model_fields["steps"].default))
    data.setdefault("eval_every", max(1, steps // eval_points))
    data.update(save_every=steps, keep_last=1)
    return data


class AblationSettings(BaseModel):
    """What every training study has beside its own settings: the base recipe, where it writes, how runs train.

    ``base`` is merged over ``BASE``, the recipe fields where the study differs from ``TrainConfig``'s
    defaults (``study_base``); ``WHAT`` names the study in error messages.
    """

    model_config = ConfigDict(extra="forbid")

    BASE: ClassVar[dict[str, Any]] = {}
    EVAL_POINTS: ClassVar[int] = 10
    WHAT: ClassVar[str] = "ablation setting"
    TEXT_ONLY: ClassVar[bool] = False  # the study trains text models: a vision-language preset is refused

    base: TrainConfig
    out: str
    keep_weights: bool = Field(default=False, description="Keep each run's checkpoints and final model.")
    threads: int | None = Field(
        default=None,
        gt=0,
        description="torch threads per run (unset: this process's threads divided among the jobs, at least 1)",
    )
    jobs: int = Field(
        default=1,
        gt=0,
        description="Runs trained at once, in worker processes when > 1 (output in OUT/logs/)",
    )

    @model_validator(mode="before")
    @classmethod
    def _study_base(cls, data: Any) -> Any:
        if isinstance(data, dict) and not isinstance(data.get("base"), TrainConfig):
            data = {**data, "base": study_base(cls.BASE, data.get("base") or {}, cls.EVAL_POINTS)}
        return data

    @model_validator(mode="after")
    def _text_preset(self) -> AblationSettings:
        preset = get_preset(self.base.preset)
        if self.TEXT_ONLY and preset.is_vision_language:
            raise ValueError(
                f"this study trains text models; {preset.name!r} is a vision-language preset "
                f"(use its language model, --preset {preset.language_model})"
            )
        return self


def study_recipe(recipe: str | os.PathLike[str] | None) -> dict[str, Any]:
    """A study's recipe file as settings data: a TOML with a ``[base]`` table holds the study's settings;
    one without is a training recipe alone (the older form), which becomes ``base``."""
    data = read_recipe(recipe)
    return data if not data or "base" in data else {"base": data}


def load_settings(
    settings: type[Settings],
    recipe: str | os.PathLike[str] | None = None,
    overlay: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Settings:
    """A study's settings from ``overlay`` (a profile such as ``--quick``), then ``recipe``
    (``study_recipe``), then ``overrides`` (dotted keys, None ignored); errors name the field."""
    data = merge_tables(copy.deepcopy(dict(overlay or {})), study_recipe(recipe))
    return validate_config(settings, set_dotted(data, overrides), getattr(settings, "WHAT", None))


def ordered_subset(names: list[str], allowed: tuple[str, ...], what: str) -> list[str]:
    """``names`` in the order of ``allowed``, without repeats; ValueError when empty or one is unknown."""
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        raise ValueError(f"{what} must be a non-empty subset of {list(allowed)}, got {names}")
    return [name for name in allowed if name in names]


def tokens_per_step(config: TrainConfig) -> int:
    """Tokens of one optimizer step: rows × tokens per row × micro-batches."""
    return config.batch_size * config.seq_len * config.grad_accum


def recipe_settings(base: TrainConfig) -> dict[str, Any]:
    """What the runs of a study share, for its report: model, tokens, data, precision, seed, schedule."""
    per_step = tokens_per_step(base)
    return {
        "preset": base.preset,
        "steps": base.steps,
        "batch_size": base.batch_size,
        "seq_len": base.seq_len,
        "grad_accum": base.grad_accum,
        "tokens_per_step": per_step,
        "tokens": base.steps * per_step,
        "data": base.data or "embedded stdlib corpus",
        "data_max_bytes": base.data_max_bytes,
        "vocab_size": base.vocab_size,
        "precision": base.precision,
        "seed": base.seed,
        "schedule": base.schedule.model_dump(mode="json"),
        "eval_every": base.eval_every,
        "eval_batches": base.eval_batches,
    }


def with_updates(base: TrainConfig, **update: Any) -> TrainConfig:
    """``base`` with top-level fields replaced (validated again)."""
    return TrainConfig.model_validate({**base.model_dump(), **update})


def val_points(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, validation loss) of every record of a run's metrics that has one."""
    return [(r["step"], float(r["val_loss"])) for r in records if "val_loss" in r]


def run_times(summary: dict[str, Any], reused: bool) -> dict[str, Any]:
    """The last keys of a run's figures: its training wall and CPU time, and whether it was reused."""
    return {
        "seconds": summary.get("seconds", math.nan),
        "cpu_seconds": summary.get("cpu_seconds", math.nan),
        "reused": reused,
    }


# what an interrupted run of a study says: the study has no --resume, and runs its unfinished runs again
RERUN_HINT = "running the study again starts this run afresh (a study reuses only finished runs)"


# ---- running ---------------------------------------------------------------------------------------------
def train_or_reuse(config: TrainConfig, keep_weights: bool) -> tuple[dict, bool]:
    """Run ``config`` (``run_training``) unless its directory holds a finished run of the same recipe.

    Returns the run's summary (with ``seconds``, the wall time of the training call, and ``cpu_seconds``,
    the CPU time this process spent in it over all its threads) and whether it was reused. A directory
    with an unfinished or different run is wiped first: it belongs to the study; one that holds anything
    else is refused (``check_run_directory``). A run that diverges
    (``TrainingDiverged``) is a result, not a failure: its summary has a NaN ``val_loss``, the steps it
    applied and the reason under ``diverged``.
    """
    run_dir = Path(config.out)
    marker = run_dir / RUN_MARKER
    recipe = config.model_dump(mode="json")
    if marker.is_file():
        try:
            previous = json.loads(marker.read_text())
        except json.JSONDecodeError:
            previous = {}
        if previous.get("recipe") == recipe and read_metrics(run_dir):
            return previous["summary"], True
    if run_dir.exists():
        check_run_directory(run_dir)
        shutil.rmtree(run_dir)
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        summary = dict(run_training(config, resume_hint=RERUN_HINT))
    except TrainingDiverged as error:  # an outcome of the study: the run's curve ends where it diverged
        summary = {"val_loss": math.nan, "steps": error.step - 1, "diverged": str(error)}
    summary["seconds"] = time.perf_counter() - start
    summary["cpu_seconds"] = time.process_time() - cpu_start
    if not keep_weights:
        drop_weights(run_dir)
    atomic_write_text(marker, json.dumps({"recipe": recipe, "summary": summary}, indent=2) + "\n")
    return summary, False


def check_run_directory(run_dir: Path, marker: str = RUN_MARKER) -> None:
    """Refuse (one-line ``K2LabError``) a run directory that a study would wipe although it is not a run: it
    must be new, empty, a run of the study (it holds ``marker``: ``RUN_MARKER``, or ``parl_config.json`` for
    ``ablate parl``) or an earlier k2lab run (``refuse_foreign``). Wiping any existing directory deleted a
    folder of notes at ``OUT/runs/none``."""
    if run_dir.exists() and not run_dir.is_dir():
        raise K2LabError(f"{run_dir} exists and is not a directory; the study trains a run there")
    consequence = "the study replaces the directories of its runs, so move it away or choose another --out"
    refuse_foreign(run_dir, consequence, (marker,))


def make_output_directory(out: str | os.PathLike[str]) -> Path:
    """Make a study's output directory (``--out``) and return it; a file in its place or a path that cannot
    be made is a one-line ``K2LabError`` (``make_directory``), not a traceback."""
    return make_directory(Path(out), "the study's output directory (--out)")


def drop_weights(run_dir: Path) -> None:
    """Delete a finished run's checkpoints and final model."""
    for name in ("checkpoints", "model"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


class PlannedRun(NamedTuple):
    """One run of a study: its recipe, the title printed above it, its log file name (``jobs > 1``)."""

    config: TrainConfig
    title: str
    log_name: str


def train_runs(
    plan: list[PlannedRun],
    ablation: AblationSettings,
    console: Console,
    done: Callable[[int, dict, bool], None],
) -> tuple[list[tuple[dict, bool]], int]:
    """Train (or reuse) every run of ``plan``; returns their (summary, reused) in plan order and the threads
    each run had.

    With ``ablation.jobs == 1`` the runs train one after another in this process (live progress). With more
    jobs they train in that many spawned worker processes, each with ``ablation.threads`` torch threads
    (default: this process's threads divided among the jobs) and its output in ``OUT/logs/{log_name}.log``.
    ``done(index, summary, reused)`` is called as each run finishes. A run directory that holds anything but
    a run (``check_run_directory``) is refused before any run trains.
    """
    for run in plan:  # before training anything: a directory the study may not replace
        check_run_directory(Path(run.config.out))
    jobs, keep_weights = ablation.jobs, ablation.keep_weights
    available = torch.get_num_threads()
    per_run = ablation.threads or (available if jobs == 1 else max(1, available // jobs))
    outcomes: list[tuple[dict, bool] | None] = [None] * len(plan)
    if jobs == 1:
        torch.set_num_threads(per_run)
        try:
            for index, run in enumerate(plan):
                console.rule(f"[{index + 1}/{len(plan)}] {run.title}")
                outcomes[index] = train_or_reuse(run.config, keep_weights)
                done(index, *outcomes[index])
        finally:
            torch.set_num_threads(available)
    else:
        _train_in_workers(plan, ablation, per_run, console, outcomes, done)
    return [outcome for outcome in outcomes if outcome is not None], per_run


def _train_in_workers(
    plan: list[PlannedRun],
    ablation: AblationSettings,
    per_run: int,
    console: Console,
    outcomes: list[tuple[dict, bool] | None],
    done: Callable[[int, dict, bool], None],
) -> None:
    """``plan`` on ``ablation.jobs`` spawned worker processes, filling ``outcomes`` as runs finish."""
    logs = make_directory(Path(ablation.out) / "logs", "the study's log directory")
    console.print(
        f"{len(plan)} runs on {ablation.jobs} worker processes × {per_run} torch threads; "
        f"per-run output in {logs}/"
    )
    context = multiprocessing.get_context("spawn")  # no fork after OpenMP threads have started
    with ProcessPoolExecutor(ablation.jobs, mp_context=context) as pool:
        futures = {
            pool.submit(
                _train_in_worker,
                run.config.model_dump(mode="json"),
                ablation.keep_weights,
                per_run,
                str(logs / f"{run.log_name}.log"),
            ): index
            for index, run in enumerate(plan)
        }
        for future in as_completed(futures):
            index = futures[future]
            outcomes[index] = future.result()
            done(index, *outcomes[index])


def _train_in_worker(config_data: dict, keep_weights: bool, threads: int, log: str) -> tuple[dict, bool]:
    """One run in a worker process, its console output going to ``log``."""
    torch.set_num_threads(threads)
    config = TrainConfig.model_validate(config_data)
    with (
        open(log, "w", encoding="utf-8") as handle,
        contextlib.redirect_stdout(handle),
        contextlib.redirect_stderr(handle),
    ):
        return train_or_reuse(config, keep_weights)


@dataclass
class StudyRun:
    """One invocation of a training study: it trains the plan, then records the times and writes the report.

    ``start`` is the clock the wall time and the progress lines count from; ``threads`` the torch threads
    each run had (set by ``train``).
    """

    ablation: AblationSettings
    console: Console
    start: float = field(default_factory=time.perf_counter)
    threads: int = 0

    def __post_init__(self) -> None:
        make_output_directory(self.ablation.out)

    def train(
        self,
        plan: list[PlannedRun],
        describe: Callable[[int, dict], str],
        ablation: AblationSettings | None = None,
    ) -> list[tuple[dict, bool]]:
        """Train (or reuse) ``plan`` under ``ablation`` (default: this study's settings), printing
        ``[i/n] {describe(index, summary)}`` as each run finishes; returns (summary, reused) per run."""

        def done(index: int, summary: dict, reused: bool) -> None:
            self.console.print(
                f"[{index + 1}/{len(plan)}] {describe(index, summary)}{' (reused)' if reused else ''}; "
                f"elapsed {time.perf_counter() - self.start:.0f}s"
            )

        outcomes, self.threads = train_runs(plan, ablation or self.ablation, self.console, done)
        return outcomes

    def finish(self, results: dict[str, Any], runs: list[dict[str, Any]], report: Report) -> dict[str, Any]:
        """The common tail: the threads, jobs, summed training times of ``runs`` and the wall time go into
        ``results``, then ``report`` writes OUT/{stem}.md|json|png and prints its summary."""
        results["settings"].update(threads=self.threads, jobs=self.ablation.jobs)
        results["wall_seconds"] = time.perf_counter() - self.start
        for key in ("seconds", "cpu_seconds"):
            values = [run.get(key, math.nan) for run in runs]
            results[f"training_{key}"] = sum(values) if all(math.isfinite(v) for v in values) else math.nan
        return report.write(results, Path(self.ablation.out), self.console)
