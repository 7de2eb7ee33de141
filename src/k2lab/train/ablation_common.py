"""What every ablation shares: the base recipe, training (or reusing) its runs, and writing the outputs.

An ablation is a list of ``TrainConfig`` that differ in one setting and in their run directory, so data
order, initial weights, schedule and evaluation batches are the same for every run. ``base_recipe`` builds
the common recipe from an ablation's defaults, a TOML recipe and overrides; ``train_runs`` trains the runs
one after another in this process or in spawned worker processes (``jobs > 1``), reusing every run
directory that already holds a finished run of exactly the same recipe (``ablation_run.json``), so an
interrupted ablation continues where it stopped. The helpers below write the JSON / markdown outputs
atomically and format the tables.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text
from k2lab.train.config import TrainConfig, load_train_config
from k2lab.train.metrics import read_metrics

RUN_MARKER = "ablation_run.json"


class AblationSettings(BaseModel):
    """What every ablation has beside its own settings: the base recipe, where it writes, how runs train."""

    model_config = ConfigDict(extra="forbid")

    base: TrainConfig
    out: str
    keep_weights: bool = False
    threads: int | None = Field(
        default=None, gt=0, description="torch threads per run; None: see train_runs."
    )
    jobs: int = Field(default=1, gt=0, description="Runs trained at once, in worker processes when > 1.")


# ---- configuration -------------------------------------------------------------------------------------
def ordered_subset(names: list[str], allowed: tuple[str, ...], what: str) -> list[str]:
    """``names`` in the order of ``allowed``, without repeats; ValueError when empty or one is unknown."""
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        raise ValueError(f"{what} must be a non-empty subset of {list(allowed)}, got {names}")
    return [name for name in allowed if name in names]


def _merge(into: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "model_overrides":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def base_recipe(
    defaults: dict[str, Any],
    recipe: str | os.PathLike[str] | None = None,
    eval_points: int = 10,
    **overrides: Any,
) -> TrainConfig:
    """``defaults``, then ``recipe`` (TOML), then ``overrides`` (dotted keys, None ignored) as one recipe.

    ``eval_every`` defaults to ``steps // eval_points``; checkpoints are written once, at the end.
    """
    data: dict[str, Any] = json.loads(json.dumps(defaults))
    if recipe is not None:
        path = Path(recipe)
        try:
            _merge(data, tomllib.loads(path.read_text()))
        except FileNotFoundError as error:
            raise K2LabError(f"recipe {path} does not exist") from error
        except tomllib.TOMLDecodeError as error:
            raise K2LabError(f"recipe {path} is not valid TOML ({error})") from error
    flat = {**_flatten(data), **{key: value for key, value in overrides.items() if value is not None}}
    steps = int(flat.get("steps", 300))
    flat.setdefault("eval_every", max(1, steps // eval_points))
    flat.update(save_every=steps, keep_last=1)
    return load_train_config(None, **flat)


def recipe_settings(base: TrainConfig) -> dict[str, Any]:
    """What the runs of an ablation share, for its report: model, tokens, data, precision, seed, schedule."""
    tokens_per_step = base.batch_size * base.seq_len * base.grad_accum
    return {
        "preset": base.preset,
        "steps": base.steps,
        "batch_size": base.batch_size,
        "seq_len": base.seq_len,
        "grad_accum": base.grad_accum,
        "tokens_per_step": tokens_per_step,
        "tokens": base.steps * tokens_per_step,
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


# ---- running ---------------------------------------------------------------------------------------------
def train_or_reuse(config: TrainConfig, keep_weights: bool) -> tuple[dict, bool]:
    """Run ``config`` (``run_training``) unless its directory holds a finished run of the same recipe.

    Returns the run's summary (with ``seconds``, the wall time of the training call, and ``cpu_seconds``,
    the CPU time this process spent in it over all its threads) and whether it was reused. A directory with an unfinished or different run is wiped first: it belongs to the ablation.
    """
    from k2lab.train.trainer import run_training

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
        shutil.rmtree(run_dir)
    start, cpu_start = time.perf_counter(), time.process_time()
    summary = dict(run_training(config))
    summary["seconds"] = time.perf_counter() - start
    summary["cpu_seconds"] = time.process_time() - cpu_start
    if not keep_weights:
        for name in ("checkpoints", "model"):
            shutil.rmtree(run_dir / name, ignore_errors=True)
    atomic_write_text(marker, json.dumps({"recipe": recipe, "summary": summary}, indent=2) + "\n")
    return summary, False


class PlannedRun(NamedTuple):
    """One run of an ablation: its recipe, the title printed above it, its log file name (``jobs > 1``)."""

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
    ``done(index, summary, reused)`` is called as each run finishes.
    """
    out, jobs, keep_weights = Path(ablation.out), ablation.jobs, ablation.keep_weights
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
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        logs = out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        console.print(
            f"{len(plan)} runs on {jobs} worker processes × {per_run} torch threads; per-run output in {logs}/"
        )
        context = multiprocessing.get_context("spawn")  # no fork after OpenMP threads have started
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = {
                pool.submit(
                    _train_in_worker,
                    run.config.model_dump(mode="json"),
                    keep_weights,
                    per_run,
                    str(logs / f"{run.log_name}.log"),
                ): index
                for index, run in enumerate(plan)
            }
            for future in as_completed(futures):
                index = futures[future]
                outcomes[index] = future.result()
                done(index, *outcomes[index])
    return [outcome for outcome in outcomes if outcome is not None], per_run


def _train_in_worker(config_data: dict, keep_weights: bool, threads: int, log: str) -> tuple[dict, bool]:
    """One run in a worker process, its console output going to ``log``."""
    import contextlib

    torch.set_num_threads(threads)
    config = TrainConfig.model_validate(config_data)
    with (
        open(log, "w", encoding="utf-8") as handle,
        contextlib.redirect_stdout(handle),
        contextlib.redirect_stderr(handle),
    ):
        return train_or_reuse(config, keep_weights)


# ---- outputs ---------------------------------------------------------------------------------------------
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
    atomic_write_text(path, json.dumps(strict_json(value), indent=2) + "\n")


def record_times(
    results: dict[str, Any],
    runs: list[dict[str, Any]],
    ablation: AblationSettings,
    threads: int,
    start: float,
) -> None:
    """Add the threads, jobs, summed training time of ``runs`` and wall time since ``start`` to ``results``."""
    results["settings"].update(threads=threads, jobs=ablation.jobs)
    results["wall_seconds"] = time.perf_counter() - start
    for key in ("seconds", "cpu_seconds"):
        values = [run.get(key, math.nan) for run in runs]
        results[f"training_{key}"] = sum(values) if all(math.isfinite(v) for v in values) else math.nan


def timing_note(results: dict[str, Any], runs: int) -> str:
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


def write_outputs(
    results: dict[str, Any],
    out: Path,
    stem: str,
    markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], Path],
) -> list[Path]:
    """``out/{stem}.json`` (strict JSON), ``out/{stem}.md`` and ``out/{stem}.png``, each written atomically."""
    paths = [out / f"{stem}.{suffix}" for suffix in ("md", "json", "png")]
    atomic_write_text(paths[0], markdown(results))
    write_json(paths[1], results)
    plot(results, paths[2])
    return paths


def fmt(value: Any, spec: str = ".3f") -> str:
    """``value`` formatted, or an em dash for None / NaN / infinity."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return format(value, spec)
