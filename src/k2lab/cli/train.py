"""Training commands: ``train`` (pre-training), ``sft``, ``stability``, ``plot``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from k2lab.cli.app import app, console
from k2lab.cli.options import Opt, runs_config
from k2lab.errors import K2LabError
from k2lab.optim.stability import StabilityConfig, stability_run
from k2lab.presets import load_preset
from k2lab.train.config import SFT_DEFAULTS, TrainConfig, load_sft_config, load_train_config
from k2lab.train.family_settings import FAMILY_SETTINGS

# the options `train` and `sft` share (help and defaults from TrainConfig's fields)
RUN_OPTIONS = {
    name: Opt(name) for name in ("out", "steps", "save_every", "batch_size", "seq_len", "precision")
}
RUN_OPTIONS["lr"] = Opt("optimizer.lr")
ResumeOption = Annotated[bool, typer.Option("--resume", help="Continue from the newest good checkpoint.")]


@app.command()
@runs_config(
    TrainConfig,
    load=load_train_config,
    options={
        "preset": Opt("preset", "-p", help="Model preset (`k2lab presets`)."),
        "data": Opt("data"),
        **RUN_OPTIONS,
        "optimizer": Opt("optimizer.name"),
        "qk_clip_tau": Opt("optimizer.qk_clip_tau"),
        "ns_precision": Opt(
            "optimizer.ns_precision", help="Newton–Schulz precision (env K2LAB_NS_PRECISION for auto)."
        ),
        "compile_step": Opt("compile", "--compile"),
        "device": Opt("device"),
        "bias_rule": Opt("balance.bias_rule"),
        "per_head_muon": Opt("optimizer.per_head_muon", "--per-head-muon/--whole-matrix-muon"),
    },
    defaults={s.path: s.help for s in FAMILY_SETTINGS},  # shown in --help; TrainConfig decides them
)
def train(
    config: TrainConfig,
    resume: ResumeOption = False,
) -> None:
    """Pre-train a K2 model with MuonClip on packed text, with telemetry, checkpoints and exact resume."""
    from k2lab.train.trainer import run_training

    run_training(config, resume=resume)


@app.command()
@runs_config(
    TrainConfig,
    load=load_sft_config,
    defaults={**SFT_DEFAULTS, "steps": "from epochs"},  # shown in --help; load_sft_config applies them
    options={
        "checkpoint": Opt("sft.init_checkpoint", "--checkpoint", "-c"),
        "data": Opt("sft.data"),
        **RUN_OPTIONS,
        "epochs": Opt("sft.epochs", help="Passes over the SFT rows (used unless steps is set)."),
        "ptx_ratio": Opt("sft.ptx_ratio", help="Fraction of rows from the pre-training corpus."),
        "ptx_data": Opt("data", help="PTX corpus directory (unset: the embedded corpus)."),
    },
)
def sft(
    config: TrainConfig,
    resume: ResumeOption = False,
) -> None:
    """Agentic SFT: fine-tune a checkpoint on chat trajectories (loss on assistant tokens), with optional
    pre-training rows mixed in; the same loop, checkpoints and exact resume as `k2lab train`. A
    vision-language checkpoint (K2.5) keeps its tower: text trajectories only is zero-vision SFT (`k2lab data
    zero-vision`), `--set sft.visual_ratio=0.3` mixes in visual ones; held-out visual scores in the summary."""
    from k2lab.train.trainer import run_training

    run_training(config, resume=resume)


@app.command()
@runs_config(
    StabilityConfig,
    options={
        "preset": Opt("preset", "-p"),
        "optimizer": Opt("optimizer.name"),
        "lr": Opt("optimizer.lr", help="Learning rate (high on purpose)."),
        "tau": Opt("optimizer.qk_clip_tau", "--qk-clip-tau"),
        "steps": Opt("steps"),
    },
)
def stability(
    config: StabilityConfig,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per step.")] = False,
) -> None:
    """Short high-lr run on one random batch: max attention logit per step with and without QK-Clip."""
    history = stability_run(load_preset(config.preset), config.optimizer, steps=config.steps)
    if as_json:
        for step, stats in enumerate(history, start=1):
            print(json.dumps({"step": step, **stats}))
        return
    settings = config.optimizer
    clip = f", τ {settings.qk_clip_tau}" if settings.name == "muonclip" else " (no QK-Clip)"  # only it clips
    table = Table(title=f"{config.preset}, {settings.name}, lr {settings.lr}{clip}")
    for column in ("step", "loss", "max logit", "after clip", "clipped heads", "ever clipped"):
        table.add_column(column, justify="right")
    for step, stats in enumerate(history, start=1):
        table.add_row(
            str(step),
            f"{stats['loss']:.3f}",
            f"{stats['max_logit']:.2f}",
            f"{stats['max_logit_clipped']:.2f}",
            f"{stats['qk_clipped_heads']:.0f}",
            f"{stats['qk_clip_ever_frac']:.0%}",
        )
    console.print(table)


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="Run directory holding metrics.jsonl.")],
    tau: Annotated[
        float | None,
        typer.Option(
            "--tau",
            help="QK-Clip τ line on the max-logit panel (default: the τ the run recorded in summary.json or "
            "an ablation marker, else none).",
        ),
    ] = None,
) -> None:
    """Draw RUN_DIR/dashboard.png from RUN_DIR/metrics.jsonl (loss, lr, max logit vs τ, clipping, expert load).

    Unreadable lines are skipped (and counted); a metrics.jsonl with no readable record draws nothing.
    """
    from k2lab.train.dashboard import plot_dashboard

    _check_metrics(run_dir)
    if tau is None:
        tau = _recorded_tau(run_dir)
    path = plot_dashboard(run_dir, tau=tau)
    console.print(f"wrote {path}", soft_wrap=True)


def _check_metrics(run_dir: Path) -> None:
    """Refuse a metrics.jsonl without one readable record (the dashboard would be blank, replacing a good one);
    say how many lines are skipped as unreadable. A missing file is left to ``plot_dashboard`` to report."""
    from k2lab.train.metrics import METRICS_FILE, scan_metrics

    records, skipped = scan_metrics(run_dir)
    path = run_dir / METRICS_FILE
    if path.is_file() and not records:
        raise K2LabError(f"{path} holds no readable records: nothing to plot")
    if skipped:
        console.print(f"skipped {skipped} unreadable line(s) of {path}", highlight=False, soft_wrap=True)


def _recorded_tau(run_dir: Path) -> float | None:
    """τ of the run's recipe when its ``summary.json`` (a finished training run) or an ablation marker records
    it, else None."""
    for name, keys in (
        ("summary.json", ("qk_clip_tau",)),
        ("ablation_run.json", ("recipe", "optimizer", "qk_clip_tau")),
    ):
        try:
            value: Any = json.loads((run_dir / name).read_text())
            for key in keys:
                value = value[key]
            return float(value)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None
