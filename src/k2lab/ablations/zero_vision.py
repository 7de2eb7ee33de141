"""Zero-vision SFT ablation (K2.5): text-only SFT vs text-vision SFT from the same joint pre-trained model,
then outcome-based visual RL from each.

K2.5: "after approximately 15T mixed-token joint pre-training, the team finds that hand-built visual CoT and
crop/rotate/flip trajectories do worse on visual-agentic tasks than text-only SFT"; visual RL then "forces
the model to use visual evidence". The study, at small scale:

1. **Base**: ``base_checkpoint`` (a vision-language model directory with tokenizer.json), or a joint
   pre-training run of ``pretrain`` (default: the vision-injection study's early 10:90 arm, k25-mini 200
   steps) in ``OUT/runs/pretrain``.
2. **Trajectories**: ``count`` zero-vision conversations (``k2lab.vision.text_trajectories``: the scene as
   Python data, a program over it, its output and the answer) from ``trajectory_seed``, written once to
   ``OUT/zero_vision-n{count}-seed{seed}.jsonl``.
3. **SFT arms**, one ``run_training`` each with the same recipe ``base`` (steps S, batch B, lr, seed, so the
   same conversation rows in the same order), differing only in ``sft.visual_ratio`` v:

   | arm         | v               | rows of micro-batch m                                             |
   |-------------|-----------------|-------------------------------------------------------------------|
   | zero-vision | 0               | B conversation rows                                               |
   | text-vision | ``visual_ratio``| B − n(m) conversation rows + n(m) = ⌊(m+1)·B·v⌋ − ⌊m·B·v⌋ visual rows|

   so both arms train on S·B rows, the text-vision arm ⌊S·B·v⌋ of them hand-designed visual trajectories
   (``k2lab.vision.visual_trajectories``: the image, a visual chain of thought, the answer). Unless
   ``base.seq_len`` is given, a row holds the longest trajectory in the base's tokenizer and chat format
   (``seq_len = 64·⌈(L_max − 1)/64⌉``, checked against the base's ``max_position_embeddings``), so nothing
   is cut.
4. **Reference** ("no SFT"): the base itself asked in chat (``evaluate_visual_tasks(chat=True)``, with images
   and on gray images), on the same held-out samples as the arms' final evaluation.
5. **Visual RL** (``k2lab.vision.rl``, ``rl_iterations`` > 0) from each arm's model, with the held-out chat
   scores of its tasks before and after, and the language model's held-out text loss before and after
   (K2.5: text benchmarks did not drop after visual RL); its text is the validation split of the pre-training
   corpus (``pretrain.data``) when the study pre-trains the base, unless ``rl.text_eval_data`` says otherwise.

Scores are mean K2.5 visual rewards in [0, 1]; the gray-image mean is what the language prior alone earns.
Outputs: ``OUT/zero_vision.json`` (everything), ``.md`` (the table and the seed's claim beside ours) and
``.png``. Runs live in ``OUT/runs/{pretrain, zero-vision, text-vision, reference, rl-zero-vision,
rl-text-vision}`` and are reused when the command is repeated with the same settings; a base whose weights
changed (``checkpoint_fingerprint``) trains every arm again.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator
from rich.console import Console

from k2lab.ablations.common import (
    RERUN_HINT,
    RUN_MARKER,
    AblationSettings,
    PlannedRun,
    StudyRun,
    check_run_directory,
    merge_tables,
    recipe_settings,
    run_times,
    study_base,
    with_updates,
)
from k2lab.ablations.report import Report, finish_axes, fmt, md_table, new_figure, rich_table, timing_note
from k2lab.ablations.vision_injection import DEFAULT_RECIPE as INJECTION_RECIPE
from k2lab.agentic.sft import encode_conversations, load_conversations, load_sft_checkpoint
from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text, make_directory, save_figure_atomically
from k2lab.interrupt import last_checkpoint, reports_interrupt
from k2lab.model_dir import check_model_directory, checkpoint_fingerprint, load_model
from k2lab.runtime.chat_format import chat_format_of
from k2lab.train.config import TrainConfig
from k2lab.train.data import language_model
from k2lab.train.metrics import read_metrics
from k2lab.train.sections import SFTConfig, VisionDataConfig, check_task_kinds
from k2lab.vision.evaluate import visual_and_blind_scores
from k2lab.vision.rewards import TASK_KINDS
from k2lab.vision.rl import SUMMARY, VisualRLConfig, run_visual_rl
from k2lab.vision.text_trajectories import ZeroVisionConfig, write_zero_vision
from k2lab.vision.vlm import VisionLanguageModel

ARMS = ("zero-vision", "text-vision")
REFERENCE = "reference"
LABELS = {REFERENCE: "no SFT (base)", "zero-vision": "zero-vision SFT", "text-vision": "text-vision SFT"}
COLORS = {REFERENCE: "tab:gray", "zero-vision": "tab:green", "text-vision": "tab:orange"}
SHORT = {"counting": "count", "grounding_box": "box", "grounding_point": "point", "segmentation": "seg"}
ROW_QUANTUM = 64  # seq_len is the longest trajectory rounded up to a multiple of this
BASE_RECORD = "base.json"  # OUT/runs/base.json: the fingerprint of the base the arms were trained from
CLAIM = (
    "K2.5 (seed): after ~15T mixed-token joint pre-training, text-only (zero-vision) SFT activates visual "
    "agentic behaviour better than text-vision SFT with hand-designed visual trajectories (visual CoT, "
    "crop/rotate/flip), whose narrow operation set constrained generalization; outcome-based visual RL then "
    "forces the model to use visual evidence. Preliminary experiments, no numbers published."
)

# The early 10:90 arm of ``ablate vision-injection`` (k25-mini, 200 steps × 8×256 tokens, wsd): ~7 min alone
# on 2 CPU cores.
PRETRAIN_RECIPE: dict[str, Any] = merge_tables(
    dict(INJECTION_RECIPE), {"vision": {"start": 0.0, "ratio": 0.1}, "eval_every": 20}
)
# The SFT arms' shared recipe, on a k25-mini base (vocab 8192: the 600 trajectories are ≤ 412 tokens, so
# rows of 513 and ~400 rows per epoch): 50 steps × 8 rows is one epoch, ~2.9 s a step in a one-thread
# worker, ~2.5 min per arm with its final evaluation (60 samples × 192 tokens, with and without images).
DEFAULT_SFT: dict[str, Any] = {
    "steps": 50,
    "batch_size": 8,
    "eval_batches": 4,
    "sample_tokens": 0,
    "optimizer": {"lr": 1e-3},
    "schedule": {"warmup_steps": 5},
}
# Visual RL from each arm: counting and OCR (the tasks k25-mini's pre-training learns), 96 new tokens (a
# zero-vision answer to them, program and output included, is ≤ 75 tokens): ~7.5 s an iteration, so 16
# iterations and 40 held-out samples before and after take ~2.5 min per arm.
DEFAULT_RL: dict[str, Any] = {"max_new_tokens": 96, "eval_samples": 40}


class ZeroVisionSettings(AblationSettings):
    """What to run: the base (given or pre-trained), the trajectories, the SFT recipe, the arms' evaluation
    and visual RL. ``jobs`` (default 2) worker processes train the arms side by side, then run the RL runs
    and the reference evaluation."""

    BASE = DEFAULT_SFT
    WHAT = "zero-vision ablation setting"

    base_checkpoint: str | None = Field(
        default=None,
        description="Vision-language model directory with tokenizer.json to start from (unset: pre-train one "
        "with `pretrain` in OUT/runs/pretrain)",
    )
    pretrain: TrainConfig = Field(
        default=None,  # type: ignore[assignment]  # filled from PRETRAIN_RECIPE
        description="Joint pre-training recipe when no base_checkpoint is given (default: K2.5's early 10:90)",
    )
    count: int = Field(default=600, ge=2, description="Zero-vision trajectories written")
    trajectory_seed: int = Field(default=0, ge=0, description="Seed of the trajectories' scenes")
    visual_ratio: float = Field(
        default=0.3,
        gt=0,
        lt=1,
        description="Share of the text-vision arm's rows that are visual trajectories",
    )
    tasks: tuple[str, ...] = Field(
        default=TASK_KINDS, description="Visual task kinds of the visual rows and of the held-out evaluation"
    )
    eval_samples: int = Field(default=60, ge=1, description="Held-out visual samples scored per arm")
    eval_max_new_tokens: int = Field(
        default=192, gt=0, description="Longest answer scored (a zero-vision reply is ≤ 171 tokens)"
    )
    rl_iterations: int = Field(
        default=16, ge=0, description="Visual RL iterations from each SFT arm (0: no visual RL)"
    )
    rl: VisualRLConfig = Field(
        default=None,  # type: ignore[assignment]  # filled from DEFAULT_RL
        description="Visual RL settings but the iterations (rl_iterations)",
    )
    jobs: int = Field(
        default=2, gt=0, description="Worker processes (arms, RL runs and the reference at once)"
    )
    out: str = Field(default="runs/zero-vision", description="Output directory")

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if not isinstance(data.get("pretrain"), TrainConfig):
            data["pretrain"] = study_base(PRETRAIN_RECIPE, data.get("pretrain") or {}, 10)
        rl = data.get("rl")
        if isinstance(rl, dict) and "iterations" in rl:
            raise ValueError("set the visual RL iterations with rl_iterations, not rl.iterations")
        if not isinstance(rl, VisualRLConfig):
            data["rl"] = merge_tables(dict(DEFAULT_RL), rl or {})
        return data

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: tuple[str, ...]) -> tuple[str, ...]:
        check_task_kinds("tasks", tuple(tasks))
        return tuple(tasks)

    @model_validator(mode="after")
    def _recipes(self) -> ZeroVisionSettings:
        if self.base.sft is not None or self.base.curriculum:
            raise ValueError(
                "base is the arms' shared recipe: the study sets [sft] itself, and a row is one seq_len"
            )
        if self.pretrain.vision is None:
            raise ValueError(
                f"pretrain.preset {self.pretrain.preset!r} is not a vision-language preset (e.g. k25-mini)"
            )
        return self

    def rl_config(self) -> VisualRLConfig:
        """The visual RL settings with ``rl_iterations`` (at least 1: a config of no RL is never run); the
        held-out text is the pre-training corpus's when this study pre-trains the base and ``rl`` names
        none."""
        update: dict[str, Any] = {"iterations": max(self.rl_iterations, 1)}
        if self.base_checkpoint is None and "text_eval_data" not in self.rl.model_fields_set:
            update["text_eval_data"] = self.pretrain.data
        return self.rl.model_copy(update=update)

    def evaluation(self) -> VisionDataConfig:
        """The held-out evaluation of the arms and the reference."""
        return VisionDataConfig(
            tasks=self.tasks, eval_samples=self.eval_samples, eval_max_new_tokens=self.eval_max_new_tokens
        )


def run_dir(settings: ZeroVisionSettings, name: str) -> Path:
    return Path(settings.out) / "runs" / name


def pretrain_config(settings: ZeroVisionSettings) -> TrainConfig:
    """The joint pre-training run of the base (no ``base_checkpoint``)."""
    return with_updates(settings.pretrain, out=str(run_dir(settings, "pretrain")))


def arm_config(
    settings: ZeroVisionSettings, arm: str, checkpoint: Path, data: Path, seq_len: int
) -> TrainConfig:
    """The shared recipe with this arm's ``[sft]`` (``visual_ratio`` 0 for zero-vision), rows of ``seq_len``
    and its own run directory."""
    sft = SFTConfig(
        init_checkpoint=str(checkpoint),
        data=str(data),
        visual_ratio=settings.visual_ratio if arm == "text-vision" else 0.0,
        visual_tasks=settings.tasks,
        visual_eval_samples=settings.eval_samples,
        visual_eval_max_new_tokens=settings.eval_max_new_tokens,
    )
    return with_updates(settings.base, sft=sft.model_dump(), seq_len=seq_len, out=str(run_dir(settings, arm)))


def visual_rows(config: TrainConfig) -> int:
    """⌊S·G·B·v⌋: the visual-trajectory rows of an SFT arm (Σₘ n(m), ``vision_rows_at`` from micro-batch 0)."""
    from k2lab.vision.mixture import vision_rows_at  # noqa: PLC0415 - beside its one use

    micro = config.steps * config.grad_accum
    return sum(vision_rows_at(m, config.batch_size, config.sft.visual_ratio, 0) for m in range(micro))


# ---- the trajectories and the row length -----------------------------------------------------------------
def write_trajectories(settings: ZeroVisionSettings) -> Path:
    """``OUT/zero_vision-n{count}-seed{seed}.jsonl``, written once (the name holds what decides its content)."""
    path = Path(settings.out) / f"zero_vision-n{settings.count}-seed{settings.trajectory_seed}.jsonl"
    if not path.is_file():
        partial = path.with_suffix(".partial")
        write_zero_vision(ZeroVisionConfig(out=partial, count=settings.count, seed=settings.trajectory_seed))
        partial.replace(path)
    return path


def longest_trajectory(checkpoint: Path, data: Path) -> tuple[int, int]:
    """(L_max, the tokens of the longest conversation of ``data`` in the checkpoint's tokenizer and chat
    format; the checkpoint's ``max_position_embeddings``)."""
    tokenizer, model = load_sft_checkpoint(checkpoint)
    chat_format = chat_format_of(model, "typescript", tokenizer)
    encoded = encode_conversations(load_conversations(data), tokenizer, 2**62, chat_format=chat_format)
    return max(len(unit.ids) for unit in encoded), language_model(model).config.max_position_embeddings


def row_length(settings: ZeroVisionSettings, longest: int, context: int) -> int:
    """``base.seq_len`` when given, else 64·⌈(L_max − 1)/64⌉ (a row holds seq_len + 1 tokens); one-line
    ``K2LabError`` when that exceeds the base's context."""
    if "seq_len" in settings.base.model_fields_set:
        return settings.base.seq_len
    seq_len = ROW_QUANTUM * math.ceil((longest - 1) / ROW_QUANTUM)
    if seq_len > context:
        raise K2LabError(
            f"the longest zero-vision trajectory has {longest} tokens, and the base's context is {context} "
            f"(max_position_embeddings, fixed by the checkpoint): give --seq-len {context} to cut the longer ones"
        )
    return seq_len


def forget_stale_runs(settings: ZeroVisionSettings, fingerprint: str) -> None:
    """Delete the study's runs made from another base than ``fingerprint`` (same paths, other weights), then
    record this base in ``OUT/runs/base.json``."""
    record = make_directory(Path(settings.out) / "runs", "the study's run directory") / BASE_RECORD
    if record.is_file() and json.loads(record.read_text()).get("fingerprint") != fingerprint:
        for name in (*ARMS, REFERENCE, *(f"rl-{arm}" for arm in ARMS)):
            directory = run_dir(settings, name)
            if directory.exists():
                check_run_directory(directory)
                shutil.rmtree(directory)
    atomic_write_text(record, json.dumps({"fingerprint": fingerprint}) + "\n")


# ---- the reference and visual RL (run in workers) --------------------------------------------------------
def _reused(directory: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The summary in ``directory``'s marker when it was made with ``key``."""
    marker = directory / RUN_MARKER
    with contextlib.suppress(OSError, ValueError):
        previous = json.loads(marker.read_text())
        if previous.get("recipe") == key:
            return previous["summary"]
    return None


def _fresh(directory: Path) -> float:
    """Empty ``directory`` (a run of the study, or new) and return the start time."""
    if directory.exists():
        check_run_directory(directory)
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    return time.perf_counter()


def _finish(directory: Path, key: dict[str, Any], summary: dict[str, Any], start: float) -> tuple[dict, bool]:
    summary["seconds"] = time.perf_counter() - start
    atomic_write_text(
        directory / RUN_MARKER, json.dumps({"recipe": key, "summary": summary}, indent=2) + "\n"
    )
    return summary, False


def reference_scores(checkpoint: str, evaluation: dict, seed: int, directory: str) -> tuple[dict, bool]:
    """The base asked in chat, with its images and on gray ones (``evaluate_visual_tasks``, as an SFT run's
    final evaluation with the same seed); reused from ``directory`` when made with the same settings."""
    run = Path(directory)
    key = {"checkpoint": checkpoint_fingerprint(checkpoint), "evaluation": evaluation, "seed": seed}
    if (summary := _reused(run, key)) is not None:
        return summary, True
    start = _fresh(run)
    tokenizer, model = load_sft_checkpoint(Path(checkpoint))
    settings = VisionDataConfig.model_validate(evaluation)
    summary = visual_and_blind_scores(model, tokenizer, settings, seed=seed, chat=True)
    return _finish(run, key, summary, start)


def visual_rl(checkpoint: str, rl: dict, directory: str, keep_weights: bool) -> tuple[dict, bool]:
    """``run_visual_rl`` from an SFT arm's model: its summary (held-out chat and gray-image scores before and
    after) and the mean reward per iteration; reused from ``directory`` when made with the same settings
    from the same weights."""
    run = Path(directory)
    key = {"source": checkpoint_fingerprint(checkpoint), "rl": rl}
    if (summary := _reused(run, key)) is not None:
        return summary, True
    start = _fresh(run)
    with reports_interrupt(run, last_checkpoint(run, "iteration"), RERUN_HINT):  # wiped when run again
        run_visual_rl(checkpoint, run, VisualRLConfig.model_validate(rl), resume=False)
    summary = json.loads((run / SUMMARY).read_text())
    lines = (run / "metrics.jsonl").read_text().splitlines()
    summary["rewards"] = [json.loads(line)["mean_reward"] for line in lines if line.strip()]
    if not keep_weights:
        for name in ("checkpoints", "model"):
            shutil.rmtree(run / name, ignore_errors=True)
    return _finish(run, key, summary, start)


def _job(
    function: Callable[..., tuple[dict, bool]], args: tuple, threads: int, log: str
) -> tuple[dict, bool]:
    """One job in a worker process, its console output going to ``log``."""
    torch.set_num_threads(threads)
    with (
        open(log, "w", encoding="utf-8") as handle,
        contextlib.redirect_stdout(handle),
        contextlib.redirect_stderr(handle),
    ):
        return function(*args)


def run_jobs(
    jobs: dict[str, tuple[Callable[..., tuple[dict, bool]], tuple]],
    settings: ZeroVisionSettings,
    threads: int,
    done: Callable[[str, dict, bool], None],
) -> dict[str, tuple[dict, bool]]:
    """Every ``name: (function, args)`` of ``jobs``, in this process (``settings.jobs`` 1) or in that many
    spawned workers with ``threads`` torch threads each (output in ``OUT/logs/{name}.log``)."""
    results: dict[str, tuple[dict, bool]] = {}
    if settings.jobs == 1:
        for name, (function, args) in jobs.items():
            results[name] = function(*args)
            done(name, *results[name])
        return results
    logs = make_directory(Path(settings.out) / "logs", "the study's log directory")
    context = multiprocessing.get_context("spawn")  # no fork after OpenMP threads have started
    with ProcessPoolExecutor(settings.jobs, mp_context=context) as pool:
        futures = {
            pool.submit(_job, function, args, threads, str(logs / f"{name}.log")): name
            for name, (function, args) in jobs.items()
        }
        for future in as_completed(futures):
            name = futures[future]
            results[name] = future.result()
            done(name, *results[name])
    return results


# ---- the study -------------------------------------------------------------------------------------------
def base_model(settings: ZeroVisionSettings, study: StudyRun) -> Path:
    """``base_checkpoint``, or the model of the pre-training run (trained, or reused, in this process)."""
    if settings.base_checkpoint is not None:
        path = check_model_directory(settings.base_checkpoint)
        if not isinstance(load_model(path), VisionLanguageModel):  # before any arm trains on it
            raise K2LabError(
                f"{path} is a text model; the study starts from a vision-language one (a k25 run's model, "
                "or leave --base-checkpoint unset to pre-train k25-mini)"
            )
        return path
    config = pretrain_config(settings)
    plan = [
        PlannedRun(config, f"joint pre-training of the base ({config.preset}) → {config.out}", "pretrain")
    ]
    keep = settings.model_copy(update={"jobs": 1, "keep_weights": True})  # the base's weights are needed
    study.train(plan, lambda _, s: f"base pre-trained: text val loss {s.get('val_loss', math.nan):.4f}", keep)
    return Path(config.out) / "model"


def run_zero_vision(settings: ZeroVisionSettings, console: Console | None = None) -> dict[str, Any]:
    """Base, trajectories, both SFT arms, the reference and visual RL (each reused when finished); writes
    OUT/zero_vision.{json,md,png} and returns the results."""
    study = StudyRun(settings, console or Console())
    checkpoint = base_model(settings, study)
    fingerprint = checkpoint_fingerprint(checkpoint)
    forget_stale_runs(settings, fingerprint)
    data = write_trajectories(settings)
    longest, context = longest_trajectory(checkpoint, data)
    seq_len = row_length(settings, longest, context)
    study.console.print(
        f"{settings.count} zero-vision trajectories in {data}: longest {longest} tokens → rows of {seq_len} + 1 "
        f"(base context {context})"
    )
    configs = {arm: arm_config(settings, arm, checkpoint, data, seq_len) for arm in ARMS}
    plan = [PlannedRun(config, f"{LABELS[arm]} → {config.out}", arm) for arm, config in configs.items()]
    keep = settings.keep_weights or settings.rl_iterations > 0  # visual RL starts from the arms' models
    outcomes = study.train(
        plan,
        lambda i, s: (
            f"{LABELS[ARMS[i]]}: val loss {s.get('val_loss', math.nan):.4f}, visual mean "
            f"{fmt(s.get('visual_scores', {}).get('mean'))}"
        ),
        settings.model_copy(update={"keep_weights": keep, "jobs": min(settings.jobs, len(ARMS))}),
    )
    extra = later_jobs(settings, checkpoint, configs)

    def done(name: str, summary: dict, reused: bool) -> None:
        study.console.print(f"{name}: done{' (reused)' if reused else ''}; elapsed "
                            f"{time.perf_counter() - study.start:.0f}s")  # fmt: skip

    later = run_jobs(extra, settings, study.threads or 1, done)
    runs = [summarize_reference(*later[REFERENCE])] + [
        summarize_arm(arm, configs[arm], *outcome, later.get(f"rl-{arm}"))
        for arm, outcome in zip(ARMS, outcomes, strict=True)
    ]
    results = analyse(settings, runs, configs[ARMS[0]], fingerprint, longest)
    return study.finish(results, runs, REPORT)


def later_jobs(
    settings: ZeroVisionSettings, checkpoint: Path, configs: dict[str, TrainConfig]
) -> dict[str, tuple[Callable[..., tuple[dict, bool]], tuple]]:
    """The reference evaluation and, with ``rl_iterations`` > 0, visual RL from each arm."""
    evaluation = settings.evaluation().model_dump(mode="json")
    jobs = {
        REFERENCE: (
            reference_scores,
            (str(checkpoint), evaluation, settings.base.seed, str(run_dir(settings, REFERENCE))),
        )
    }
    if settings.rl_iterations > 0:
        rl = settings.rl_config().model_dump(mode="json")
        for arm, config in configs.items():
            source = str(Path(config.out) / "model")
            jobs[f"rl-{arm}"] = (
                visual_rl,
                (source, rl, str(run_dir(settings, f"rl-{arm}")), settings.keep_weights),
            )
    return jobs


def summarize_reference(summary: dict, reused: bool) -> dict[str, Any]:
    return {
        "arm": REFERENCE,
        "val_loss": math.nan,
        "val_curve": [],
        "visual_rows": 0,
        "visual_scores": summary["visual_scores"],
        "visual_scores_blind": summary["visual_scores_blind"],
        "rl": None,
        "seconds": summary.get("seconds", math.nan),
        "cpu_seconds": math.nan,
        "reused": reused,
    }


def summarize_arm(
    arm: str, config: TrainConfig, summary: dict, reused: bool, rl: tuple[dict, bool] | None
) -> dict[str, Any]:
    """One SFT arm: its held-out conversation loss (and curve), visual rows, scores and its visual RL."""
    records = read_metrics(config.out)
    return {
        "arm": arm,
        "val_loss": float(summary.get("val_loss", math.nan)),
        "val_curve": [
            {"step": r["step"], "val_loss": float(r["val_loss"])} for r in records if "val_loss" in r
        ],
        "visual_rows": visual_rows(config),
        "total_rows": config.steps * config.grad_accum * config.batch_size,
        "visual_scores": summary.get("visual_scores", {}),
        "visual_scores_blind": summary.get("visual_scores_blind", {}),
        "rl": None if rl is None else {**rl[0], "reused": rl[1]},
        "run_dir": str(config.out),
        **run_times(summary, reused),
    }


def analyse(
    settings: ZeroVisionSettings, runs: list[dict[str, Any]], arm: TrainConfig, fingerprint: str, longest: int
) -> dict[str, Any]:
    """Settings (the recipe of ``arm``, an SFT arm: its row length, base and trajectories), the runs and the
    task kinds scored."""
    rl = settings.rl_config()
    kinds = sorted({kind for run in runs for kind in run["visual_scores"] if kind != "mean"})
    return {
        "settings": {
            **recipe_settings(arm),
            "lr": arm.optimizer.lr,
            "base_checkpoint": arm.sft.init_checkpoint,
            "base_fingerprint": fingerprint,
            "pretrained": settings.base_checkpoint is None,
            "trajectories": arm.sft.data,
            "count": settings.count,
            "trajectory_seed": settings.trajectory_seed,
            "longest_trajectory": longest,
            "visual_ratio": settings.visual_ratio,
            "tasks": list(settings.tasks),
            "eval_samples": settings.eval_samples,
            "eval_max_new_tokens": settings.eval_max_new_tokens,
            "rl_iterations": settings.rl_iterations,
            "rl": rl.model_dump(mode="json") if settings.rl_iterations else None,
        },
        "runs": runs,
        "kinds": kinds,
        "claim": CLAIM,
    }


# ---- outputs ---------------------------------------------------------------------------------------------
def _rl_cell(run: dict[str, Any], phase: str, mode: str) -> str:
    """The mean of the visual RL run's held-out ``phase`` (before / after) scores in ``mode`` (chat / blind),
    or, ``mode`` "text_loss", its held-out text loss."""
    scores = ((run["rl"] or {}).get(phase) or {}).get(mode)
    if mode == "text_loss":
        return fmt(scores, ".4f")
    return fmt((scores or {}).get("mean"))


def tables(results: dict[str, Any], short: bool = False) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows): the comparison (one row per arm and the reference) and, ``short`` (an
    80-column console), its per-task scores as a second table."""
    runs, kinds = results["runs"], results["kinds"]
    names = [SHORT.get(kind, kind) if short else kind for kind in kinds]
    main = [
        [
            LABELS[run["arm"]],
            fmt(run["val_loss"], ".4f"),
            fmt(run["visual_scores"].get("mean")),
            fmt(run["visual_scores_blind"].get("mean")),
            *([] if short else [fmt(run["visual_scores"].get(kind)) for kind in kinds]),
            _rl_cell(run, "before", "chat"),
            _rl_cell(run, "after", "chat"),
            _rl_cell(run, "after", "blind"),
            _rl_cell(run, "before", "text_loss"),
            _rl_cell(run, "after", "text_loss"),
        ]
        for run in runs
    ]
    header = [
        "arm",
        "SFT val loss",
        "visual mean (chat)",
        "gray-image mean",
        *([] if short else names),
        "RL tasks before RL",
        "after visual RL mean",
        "gray after RL",
        "text loss before RL",
        "text loss after RL",
    ]
    if short:
        header = ["arm", "SFT val", "visual", "gray", "RL before", "RL after", "gray after", "text before",
                  "text after"]  # fmt: skip
    out = [("held-out visual scores (mean reward in [0, 1])", header, main)]
    if short:
        per_task = [[LABELS[run["arm"]], *(fmt(run["visual_scores"].get(k)) for k in kinds)] for run in runs]
        out.append(("per task, asked in chat with the image", ["arm", *names], per_task))
    return out


def markdown_report(results: dict[str, Any]) -> str:
    """The table of ``zero_vision.md``, the setting, and the seed's claim beside ours."""
    s, runs = results["settings"], results["runs"]
    arms = {run["arm"]: run for run in runs}
    text = arms.get("text-vision", {})
    rl = s["rl"]
    rl_note = (
        f"Visual RL: {s['rl_iterations']} iterations of {rl['prompts_per_iteration']} prompts × "
        f"{rl['group_size']} answers on {', '.join(rl['tasks'])} (≤ {rl['max_new_tokens']} tokens), scored on "
        f"{rl['eval_samples']} held-out samples of those tasks before and after. {text_note(results)}"
        if rl
        else "No visual RL (rl_iterations 0)."
    )
    lines = [
        f"# Zero-vision SFT ablation: {s['steps']} SFT steps × {s['batch_size']} rows of {s['seq_len']} tokens",
        "",
        f"Base: {s['base_checkpoint']}{' (joint pre-training of this study)' if s['pretrained'] else ''}. "
        f"Both arms: the same {s['count']} zero-vision trajectories (seed {s['trajectory_seed']}, longest "
        f"{s['longest_trajectory']} tokens), seed {s['seed']}, lr {s['lr']:g}; the text-vision arm has "
        f"{text.get('visual_rows', 0)} of its {text.get('total_rows', 0)} rows replaced by visual trajectories "
        f"(ratio {s['visual_ratio']:g}). SFT val loss: held-out zero-vision conversations (assistant tokens). "
        f"Visual scores: {s['eval_samples']} held-out samples of {', '.join(s['tasks'])} asked in chat (greedy, "
        f"≤ {s['eval_max_new_tokens']} new tokens); gray-image mean: the same prompts with uniform gray images "
        f"(the language prior alone). {rl_note}",
        "",
    ]
    for title, header, rows in tables(results):
        lines += [f"## {title[0].upper()}{title[1:]}", "", *md_table(header, rows), ""]
    lines += ["## The claim and ours", "", f"- {CLAIM}", f"- Here: {verdict(results)}", ""]
    lines += [timing_note(results, len(runs)), ""]
    return "\n".join(lines)


def text_note(results: dict[str, Any]) -> str:
    """What the text-loss columns measure (from a visual RL run's ``text_eval``)."""
    text = next((run["rl"].get("text_eval") for run in results["runs"] if run["rl"]), None)
    if not text:
        return "No held-out text loss (rl.text_eval_rows 0)."
    return (
        f"Text loss: the language model's mean next-token cross-entropy (nats/token) on {text['rows']} "
        f"held-out rows of {text['seq_len']} tokens of {text['corpus']}'s validation split, before and after "
        "visual RL (K2.5: its text benchmarks did not drop after visual RL, e.g. MMLU-Pro 84.7 → 86.4)."
    )


def verdict(results: dict[str, Any]) -> str:
    """One sentence: which SFT arm scores higher with images, and by how much above its gray-image prior."""
    arms = {run["arm"]: run for run in results["runs"]}

    def lift(arm: str) -> tuple[float, float]:
        run = arms[arm]
        chat = run["visual_scores"].get("mean", math.nan)
        return chat, chat - run["visual_scores_blind"].get("mean", math.nan)

    (zero, zero_lift), (text, text_lift) = lift("zero-vision"), lift("text-vision")
    if not all(map(math.isfinite, (zero, text))):
        return "no comparison (an arm has no visual scores)."
    better = "zero-vision" if zero > text else "text-vision" if text > zero else "neither"
    agrees = {"zero-vision": "agrees with", "text-vision": "contradicts", "neither": "does not decide"}[
        better
    ]
    return (
        f"zero-vision SFT {zero:.3f} (image − gray {zero_lift:+.3f}) vs text-vision SFT {text:.3f} "
        f"({text_lift:+.3f}), base {fmt(arms[REFERENCE]['visual_scores'].get('mean'))}: this run {agrees} the "
        f"claim at this scale ({results['settings']['eval_samples']} held-out samples: small differences are "
        "noise)."
    )


def plot_zero_vision(results: dict[str, Any], target: Path) -> Path:
    """``zero_vision.png``: SFT val loss vs step; scores per task kind (gray-image means dotted); visual RL's
    mean reward per iteration."""
    runs, kinds = results["runs"], [*results["kinds"], "mean"]
    figure = new_figure((16, 5))
    figure.suptitle("Zero-vision vs text-vision SFT from the same joint pre-trained base, then visual RL")
    loss_ax, score_ax, rl_ax = figure.subplots(1, 3, width_ratios=[1, 1.5, 1])
    arms = [run for run in runs if run["arm"] != REFERENCE]
    for run in arms:
        curve = run["val_curve"]
        loss_ax.plot([p["step"] for p in curve], [p["val_loss"] for p in curve], marker="o",
                     color=COLORS[run["arm"]], label=LABELS[run["arm"]])  # fmt: skip
    loss_ax.set_title("held-out trajectory loss (assistant tokens)", fontsize=10)
    finish_axes(loss_ax, "SFT step", "nats/token")
    width = 0.8 / len(runs)
    for index, run in enumerate(runs):
        offsets = [k + (index - (len(runs) - 1) / 2) * width for k in range(len(kinds))]
        bars = score_ax.bar(offsets, [run["visual_scores"].get(k, math.nan) for k in kinds], width,
                            color=COLORS[run["arm"]], label=LABELS[run["arm"]])  # fmt: skip
        score_ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
        blind = [run["visual_scores_blind"].get(k, math.nan) for k in kinds]
        score_ax.scatter(offsets, blind, marker="_", s=120, color="black", zorder=3,
                         label="gray-image score" if index == 0 else None)  # fmt: skip
    score_ax.set_xticks(range(len(kinds)), kinds, rotation=20, fontsize=8)
    score_ax.set_ylim(0, 1)
    score_ax.set_title(f"held-out visual scores in chat ({results['settings']['eval_samples']} samples)",
                       fontsize=10)  # fmt: skip
    finish_axes(score_ax, None, "mean visual reward")
    for run in arms:
        if run["rl"]:
            rewards = run["rl"]["rewards"]
            rl_ax.plot(range(1, len(rewards) + 1), rewards, marker=".", color=COLORS[run["arm"]],
                       label=f"from {LABELS[run['arm']]}")  # fmt: skip
    rl_ax.set_title("visual RL: mean reward per iteration", fontsize=10)
    finish_axes(rl_ax, "iteration", "mean reward", legend=any(run["rl"] for run in arms))
    return save_figure_atomically(figure, target)


def print_summary(results: dict[str, Any], console: Console) -> None:
    """The comparison as rich tables, and the verdict."""
    for title, header, rows in tables(results, short=True):
        console.print(rich_table(f"zero-vision ablation: {title}", header, rows))
    console.print(verdict(results), markup=False)


REPORT = Report("zero_vision", markdown_report, plot_zero_vision, print_summary)
