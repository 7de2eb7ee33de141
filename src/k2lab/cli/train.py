"""Training commands: ``train`` (pre-training), ``sft``, ``stability``, ``plot``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from k2lab.cli.app import PresetOption, app, console
from k2lab.cli.options import Opt, runs_config
from k2lab.presets import load_preset
from k2lab.train.config import TrainConfig, load_train_config


@app.command()
@runs_config(
    TrainConfig,
    load=load_train_config,
    options={
        "preset": Opt("preset", "-p", help="Model preset (`k2lab presets`)."),
        "steps": Opt("steps", help="Optimizer steps."),
        "out": Opt("out", help="Run directory."),
        "data": Opt("data"),
        "optimizer": Opt("optimizer.name", help="Optimizer."),
        "lr": Opt("optimizer.lr", help="Peak learning rate."),
        "qk_clip_tau": Opt("optimizer.qk_clip_tau", help="QK-Clip threshold τ."),
        "save_every": Opt("save_every", help="Checkpoint every K steps."),
        "batch_size": Opt("batch_size", help="Sequences per micro-batch."),
        "seq_len": Opt("seq_len", help="Tokens per sequence."),
        "precision": Opt("precision"),
        "ns_precision": Opt(
            "optimizer.ns_precision", help="Newton–Schulz precision (env K2LAB_NS_PRECISION for auto)."
        ),
        "compile_step": Opt("compile", "--compile"),
    },
)
def train(
    config: TrainConfig,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest good checkpoint.")
    ] = False,
) -> None:
    """Pre-train a K2 model with MuonClip on packed text, with telemetry, checkpoints and exact resume."""
    from k2lab.train.trainer import run_training

    run_training(config, resume=resume)


@app.command()
def sft(
    checkpoint: Annotated[
        str,
        typer.Option("--checkpoint", "-c", help="k2lab model directory with tokenizer.json (runs/X/model)."),
    ],
    data: Annotated[str, typer.Option(help="JSONL of {'messages': [...], 'tools': [...]} conversations.")],
    out: Annotated[str | None, typer.Option(help="Run directory (default runs/sft).")] = None,
    recipe: Annotated[Path | None, typer.Option(help="TOML recipe; flags below override it.")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (default: from --epochs).")] = None,
    epochs: Annotated[
        float | None, typer.Option(help="Passes over the SFT rows (default 3 unless --steps).")
    ] = None,
    ptx_ratio: Annotated[
        float | None, typer.Option(help="Fraction of rows from the pre-training corpus (default 0).")
    ] = None,
    ptx_data: Annotated[
        str | None, typer.Option(help="PTX corpus directory (default: embedded corpus).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest good checkpoint.")
    ] = False,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (default 5e-4).")] = None,
    save_every: Annotated[int | None, typer.Option(help="Checkpoint every K steps.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Rows per micro-batch (default 4).")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per row (default 1024).")] = None,
    precision: Annotated[str | None, typer.Option(help="auto, fp32 or bf16.")] = None,
) -> None:
    """Agentic SFT: fine-tune a checkpoint on chat trajectories (loss on assistant tokens), with optional
    pre-training rows mixed in; the same loop, checkpoints and exact resume as `k2lab train`."""
    from k2lab.agentic.sft import sft_train_config
    from k2lab.train.trainer import run_training

    config = sft_train_config(
        recipe,
        out=out,
        steps=steps,
        data=ptx_data,
        save_every=save_every,
        batch_size=batch_size,
        seq_len=seq_len,
        precision=precision,
        **{
            "sft.init_checkpoint": checkpoint,
            "sft.data": data,
            "sft.epochs": epochs,
            "sft.ptx_ratio": ptx_ratio,
            "optimizer.lr": lr,
        },
    )
    run_training(config, resume=resume)


@app.command()
def stability(
    preset: PresetOption = "k2-nano",
    optimizer: Annotated[str, typer.Option(help="muonclip, muon or adamw.")] = "muonclip",
    lr: Annotated[float, typer.Option(help="Learning rate (high on purpose).")] = 0.05,
    tau: Annotated[float, typer.Option("--qk-clip-tau", help="QK-Clip threshold τ.")] = 5.0,
    steps: Annotated[int, typer.Option(help="Training steps.")] = 30,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per step.")] = False,
) -> None:
    """Short high-lr run on one random batch: max attention logit per step with and without QK-Clip."""
    from k2lab.optim import OptimizerConfig
    from k2lab.optim.stability import stability_run

    settings = OptimizerConfig(name=optimizer, lr=lr, qk_clip_tau=tau)
    history = stability_run(load_preset(preset), settings, steps=steps)
    if as_json:
        for step, stats in enumerate(history, start=1):
            print(json.dumps({"step": step, **stats}))
        return
    table = Table(title=f"{preset}, {optimizer}, lr {lr}, τ {tau}")
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
            help="QK-Clip τ line on the max-logit panel (default: the τ an ablation run recorded, else none).",
        ),
    ] = None,
) -> None:
    """Draw RUN_DIR/dashboard.png from RUN_DIR/metrics.jsonl (loss, lr, max logit vs τ, clipping, expert load)."""
    from k2lab.train.dashboard import plot_dashboard

    if tau is None:
        tau = _recorded_tau(run_dir)
    path = plot_dashboard(run_dir, tau=tau)
    console.print(f"wrote {path}")


def _recorded_tau(run_dir: Path) -> float | None:
    """τ of the run's recipe when a checkpoint or an ablation marker records it, else None."""
    marker = run_dir / "ablation_run.json"
    try:
        if marker.is_file():
            return float(json.loads(marker.read_text())["recipe"]["optimizer"]["qk_clip_tau"])
    except (ValueError, KeyError, TypeError):
        pass
    return None
