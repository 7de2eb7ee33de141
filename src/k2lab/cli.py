"""The ``k2lab`` command (also ``python -m k2lab``, which torchrun needs).

Every user error (unknown preset, bad checkpoint, invalid value) is reported as one paragraph on stderr with
exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from k2lab.config import format_validation_error
from k2lab.errors import K2LabError
from k2lab.presets import available_presets, get_preset, language_model_config, load_preset

app = typer.Typer(
    name="k2lab",
    help="The Kimi K2 model family (K2, K2.5, K3): build, inspect, convert and run models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
PresetOption = Annotated[str, typer.Option("--preset", "-p", help="Preset name; `k2lab presets` lists them.")]
# options shared by the ablation commands
KeepWeightsOption = Annotated[
    bool, typer.Option("--keep-weights", help="Keep each run's checkpoints and final model.")
]
ThreadsOption = Annotated[
    int | None,
    typer.Option(help="torch threads per run (default torch's divided among the jobs, at least 1)."),
]


@app.command()
def presets() -> None:
    """List the model presets with their parameter counts (text, then vision-language)."""
    from k2lab.params import count_parameters, humanize

    table = Table(title="k2lab presets")
    for column in ("preset", "layers (MLA / KDA)", "hidden", "experts (top-k)", "total", "active"):
        table.add_column(column, justify="left" if column == "preset" else "right")
    for name in available_presets("text"):
        config = load_preset(name)
        report = count_parameters(config)
        kinds = config.layer_types
        table.add_row(
            name,
            f"{config.num_hidden_layers} ({kinds.count('mla')} / {kinds.count('kda')})",
            str(config.hidden_size),
            f"{config.n_routed_experts} ({config.num_experts_per_tok})",
            humanize(report.total),
            humanize(report.active),
        )
    console.print(table)
    _print_vlm_presets()


def _print_vlm_presets() -> None:
    """The vision-language presets: language model + vision tower (exact counts on the meta device)."""
    from k2lab.params import humanize
    from k2lab.presets import load_vlm_preset, vlm_parameter_counts

    table = Table(title="vision-language presets (train with --preset NAME)")
    for column in ("preset", "language model", "tower", "tower params", "projector", "total"):
        table.add_column(
            column, justify="left" if column in ("preset", "language model", "tower") else "right"
        )
    for name in available_presets("vision-language"):
        config = load_vlm_preset(name)
        vision = config.vision
        kind = "MoonViT-3D" if vision.is_moonvit_3d_family else "MoonViT-V2"
        counts = vlm_parameter_counts(config)
        table.add_row(
            name,
            get_preset(name).language_model,
            f"{kind} {vision.num_hidden_layers}×{vision.hidden_size}",
            humanize(counts["vision_tower"]),
            humanize(counts["projector"]),
            humanize(counts["total"]),
        )
    console.print(table)


@app.command()
def params(
    preset: PresetOption,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table.")
    ] = False,
) -> None:
    """Count total and active-per-token parameters of a preset, built on the meta device (no memory).

    For a vision-language preset: its language model, then the tower and projector."""
    from k2lab.params import PUBLISHED, count_parameters, humanize
    from k2lab.presets import load_vlm_preset, vlm_parameter_counts

    report = count_parameters(language_model_config(preset))
    vision = vlm_parameter_counts(load_vlm_preset(preset)) if get_preset(preset).is_vision_language else None
    if as_json:
        print(json.dumps({**report.to_dict(), **({"vision_language": vision} if vision else {})}))
        return
    part = " of the language model" if vision else ""
    table = Table(title=f"{preset}: parameters{part} (exact, from the model built on the meta device)")
    table.add_column("component")
    table.add_column("parameters", justify="right")
    table.add_column("share", justify="right")
    for name, count in report.components.items():
        if count:
            table.add_row(name, f"{count:,}", f"{count / report.total:.1%}")
    table.add_section()
    table.add_row("total", f"{report.total:,}", humanize(report.total))
    table.add_row("active per token", f"{report.active:,}", humanize(report.active))
    table.add_row(
        "total excl. embeddings", f"{report.total_excl_embeddings:,}", humanize(report.total_excl_embeddings)
    )
    table.add_row(
        "active excl. embeddings",
        f"{report.active_excl_embeddings:,}",
        humanize(report.active_excl_embeddings),
    )
    console.print(table)
    if report.per_expert:
        console.print(f"one routed expert: {report.per_expert:,} parameters × {report.moe_layers} MoE layers")
    if vision is not None:
        console.print(
            f"vision-language: language model {vision['language_model']:,} + tower {vision['vision_tower']:,}"
            f" + projector {vision['projector']:,} = {vision['total']:,} parameters ({humanize(vision['total'])})"
        )
    if preset in PUBLISHED:
        published = PUBLISHED[preset]
        figures = ", ".join(f"{key} {humanize(value)}" for key, value in published.items() if key != "note")
        console.print(f"published: {figures} ({published['note']})")


@app.command()
def init(
    preset: PresetOption,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the checkpoint to.")],
    seed: Annotated[int, typer.Option(help="Random seed for the initial weights.")] = 0,
    hf: Annotated[bool, typer.Option("--hf", help="Write Hugging Face DeepseekV3 format instead.")] = False,
) -> None:
    """Write a randomly initialised checkpoint of a preset (k2lab format, or HF format with --hf)."""
    from k2lab.checkpoint import save_model
    from k2lab.models import build_model
    from k2lab.params import count_parameters

    config = load_preset(preset)
    total = count_parameters(config).total
    if total > 2e9:
        raise K2LabError(
            f"preset {preset!r} has {total:,} parameters; `init` materialises weights in memory, which this "
            "command refuses above 2B. Use `k2lab params` to inspect large presets."
        )
    model = build_model(config, seed=seed)
    if hf:
        from k2lab.hf import to_hf

        to_hf(model, out)
    else:
        save_model(model, out)
    console.print(f"wrote {preset} ({total:,} parameters, seed {seed}) to {out}")


def parse_token_ids(text: str) -> list[int]:
    """'1 2 3' or '1,2,3' -> [1, 2, 3] (token ids until a tokenizer is attached)."""
    parts = [part for part in re.split(r"[\s,]+", text.strip()) if part]
    if not parts or not all(part.isdigit() for part in parts):
        raise K2LabError(
            f"--prompt must be token ids separated by spaces or commas (e.g. '1 2 3'), got {text!r}"
        )
    return [int(part) for part in parts]


def _image_prompts(model, tokenizer, images: list[Path], texts: list[str]):
    """Token ids (image placeholders + text) and pixel inputs for ``generate --image``."""
    from PIL import Image, UnidentifiedImageError

    from k2lab.vision.mixture import image_prompts
    from k2lab.vision.vlm import VisionLanguageModel

    if not isinstance(model, VisionLanguageModel):
        raise K2LabError(
            "--image needs a vision-language checkpoint (e.g. one trained with --preset k25-mini)"
        )
    if tokenizer is None:
        raise K2LabError("--image needs the checkpoint's tokenizer.json (its media tokens) and text prompts")
    if len(images) not in (1, len(texts)):
        raise K2LabError(
            f"give one --image for all prompts or one per prompt, not {len(images)} for {len(texts)}"
        )
    loaded = []
    for path in images:
        try:
            with Image.open(path) as handle:
                loaded.append(handle.convert("RGB"))
        except (OSError, UnidentifiedImageError) as error:
            raise K2LabError(f"cannot read image {path}: {error}") from error
    if len(loaded) == 1:
        loaded *= len(texts)
    try:
        return image_prompts(tokenizer, model.config.vision, loaded, texts)
    except ValueError as error:
        raise K2LabError(str(error)) from error


@app.command()
def generate(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", "-c", help="k2lab or HF checkpoint directory.")],
    prompt: Annotated[
        list[str],
        typer.Option(
            "--prompt",
            help="Text when the checkpoint has a tokenizer.json, else token ids like '1 2 3'; repeat for a batch.",
        ),
    ],
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 16,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass (1 = off).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    token_ids: Annotated[bool, typer.Option("--token-ids", help="Read prompts as token ids.")] = False,
    image: Annotated[
        list[Path] | None,
        typer.Option(
            "--image",
            help="An image (PNG, JPEG ...) placed before the prompt, at its native resolution, for a "
            "vision-language checkpoint. Give one for all prompts or one per prompt.",
        ),
    ] = None,
) -> None:
    """Generate continuations with the latent KV cache (absorbed MLA decode); with --image, from a
    vision-language checkpoint (K2.5 style) that sees the image first."""
    import time

    from k2lab.checkpoint import load_model
    from k2lab.infer import GenerationConfig
    from k2lab.infer import generate as run_generation

    tokenizer = None
    if not token_ids and (checkpoint / "tokenizer.json").is_file():
        from k2lab.data import load_tokenizer

        tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    model = load_model(checkpoint).eval()
    media = None
    if image:
        prompts, media = _image_prompts(model, tokenizer, image, prompt)
    else:
        prompts = [tokenizer.encode(text) if tokenizer else parse_token_ids(text) for text in prompt]
    decoder = getattr(model, "language_model", model)
    vocab = decoder.config.vocab_size
    for ids in prompts:
        if not ids:
            raise K2LabError("a prompt encodes to no tokens")
        if max(ids) >= vocab:
            raise K2LabError(f"prompt token id {max(ids)} is outside the model's vocabulary [0, {vocab})")
    settings = GenerationConfig(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        eos_token_id=decoder.config.eos_token_id,
    )
    start = time.perf_counter()
    outputs = run_generation(model, prompts, settings, media=media)
    seconds = time.perf_counter() - start
    for text, ids, new in zip(prompt, prompts, outputs, strict=True):
        if tokenizer:
            console.print(
                text + tokenizer.decode(new, skip_special_tokens=True), markup=False, highlight=False
            )
        else:
            console.print(f"prompt {ids} -> {new}")
    produced = sum(len(new) for new in outputs)
    console.print(f"{produced} tokens in {seconds:.2f}s ({produced / max(seconds, 1e-9):.1f} tokens/s)")


@app.command()
def serve(
    checkpoint: Annotated[
        Path,
        typer.Option("--checkpoint", "-c", help="k2lab or HF checkpoint directory with a tokenizer.json."),
    ],
    host: Annotated[str, typer.Option(help="Interface to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="K2LAB_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* (or $K2LAB_API_KEY)."
        ),
    ] = None,
    model_name: Annotated[
        str | None, typer.Option(help="Model id clients ask for (default: the directory name).")
    ] = None,
    max_batch: Annotated[
        int, typer.Option(min=1, help="Sequences decoded together (continuous batching).")
    ] = 16,
    max_context: Annotated[
        int | None, typer.Option(min=2, help="Prompt + completion limit (default: the model's).")
    ] = None,
) -> None:
    """Serve a checkpoint over an OpenAI-compatible API: /v1/models, /v1/chat/completions (streaming, tool
    calls constrained to the declared JSON Schemas), /health."""
    import uvicorn

    from k2lab.checkpoint import load_model
    from k2lab.data import load_tokenizer
    from k2lab.serve import Engine
    from k2lab.serve.server import build_app

    if not (checkpoint / "tokenizer.json").is_file():
        raise K2LabError(f"{checkpoint} has no tokenizer.json: the server renders chats to text and back")
    tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    model = load_model(checkpoint)
    model = getattr(model, "language_model", model)  # images are not served yet: text through the decoder
    engine = Engine(model, max_batch=max_batch).start()
    name = model_name or checkpoint.resolve().name
    app_ = build_app(engine, tokenizer, name, api_key=api_key, max_context=max_context)
    console.print(f"serving {name} on http://{host}:{port}/v1 (max batch {max_batch})")
    try:
        uvicorn.run(app_, host=host, port=port, log_level="warning")
    finally:
        engine.shutdown()


@app.command()
def train(
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", help="Model preset (default k2-mini).")
    ] = None,
    recipe: Annotated[Path | None, typer.Option(help="TOML recipe; flags below override it.")] = None,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps.")] = None,
    out: Annotated[str | None, typer.Option(help="Run directory.")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest good checkpoint.")
    ] = False,
    data: Annotated[
        str | None, typer.Option(help="Directory of .txt/.md/.jsonl (default: embedded corpus).")
    ] = None,
    optimizer: Annotated[str | None, typer.Option(help="muonclip, muon or adamw.")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate.")] = None,
    qk_clip_tau: Annotated[float | None, typer.Option(help="QK-Clip threshold τ.")] = None,
    save_every: Annotated[int | None, typer.Option(help="Checkpoint every K steps.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Sequences per micro-batch.")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence.")] = None,
    precision: Annotated[
        str | None, typer.Option(help="Model step: auto (bf16 where native, k2lab.hardware), fp32 or bf16.")
    ] = None,
    ns_precision: Annotated[
        str | None, typer.Option(help="Newton–Schulz: auto, fp32 or bf16 (env K2LAB_NS_PRECISION for auto).")
    ] = None,
    compile_step: Annotated[
        str | None,
        typer.Option("--compile", help="torch.compile the training step: auto (on for CUDA), on or off."),
    ] = None,
) -> None:
    """Pre-train a K2 model with MuonClip on packed text, with telemetry, checkpoints and exact resume."""
    from k2lab.train.config import load_train_config
    from k2lab.train.trainer import run_training

    config = load_train_config(
        recipe,
        preset=preset,
        steps=steps,
        out=out,
        data=data,
        save_every=save_every,
        batch_size=batch_size,
        seq_len=seq_len,
        precision=precision,
        compile=compile_step,
        **{
            "optimizer.name": optimizer,
            "optimizer.lr": lr,
            "optimizer.qk_clip_tau": qk_clip_tau,
            "optimizer.ns_precision": ns_precision,
        },
    )
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


ablate_app = typer.Typer(
    help="Ablations that train several runs on the same tokens and compare them.", no_args_is_help=True
)
app.add_typer(ablate_app, name="ablate")


@ablate_app.command("optimizer")
def ablate_optimizer(
    preset: Annotated[
        str | None,
        typer.Option("--preset", "-p", help="Model preset (default k2-mini; k2-nano with --quick)."),
    ] = None,
    steps: Annotated[
        int | None, typer.Option(help="Optimizer steps per run (default 150; 30 with --quick).")
    ] = None,
    out: Annotated[
        str | None, typer.Option(help="Output directory (default runs/ablation, runs/ablation-quick).")
    ] = None,
    lrs: Annotated[
        str | None, typer.Option(help="Comma-separated lr grid for every optimizer (default 3e-4,1e-3,3e-3).")
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Smoke run: k2-nano, 2 MB of the corpus, 30 steps (~2 min).")
    ] = False,
    recipe: Annotated[
        Path | None, typer.Option(help="TOML recipe for everything but the optimizer; flags override it.")
    ] = None,
    data: Annotated[
        str | None, typer.Option(help="Directory of .txt/.md/.jsonl (default: embedded corpus).")
    ] = None,
    tau: Annotated[float | None, typer.Option(help="MuonClip τ in the sweep (default 100).")] = None,
    stress_lr: Annotated[
        float | None, typer.Option(help="Stress setting lr (default 3e-2; 5e-2 with --quick).")
    ] = None,
    stress_tau: Annotated[
        float | None, typer.Option(help="Stress setting τ (default 10; 2 with --quick).")
    ] = None,
    stress_steps: Annotated[
        int | None, typer.Option(help="Stress setting steps (default: min(--steps, 100)).")
    ] = None,
    no_stress: Annotated[bool, typer.Option("--no-stress", help="Skip the stress setting.")] = False,
    target_loss: Annotated[
        float | None, typer.Option(help="Target val loss (default: the worst optimizer's final val loss).")
    ] = None,
    batch_size: Annotated[int | None, typer.Option(help="Sequences per micro-batch.")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence.")] = None,
    precision: Annotated[str | None, typer.Option(help="auto, fp32 or bf16.")] = None,
    keep_weights: KeepWeightsOption = False,
    optimizers: Annotated[
        str | None, typer.Option(help="Comma-separated subset of adamw,muon,muonclip (default all).")
    ] = None,
    jobs: Annotated[
        int,
        typer.Option(
            help="Runs trained at once, in worker processes (each with threads/jobs torch threads, "
            "output in OUT/logs/)."
        ),
    ] = 1,
    threads: Annotated[
        int | None,
        typer.Option(
            help="torch threads (default torch's; 1 with --quick); 1 avoids OpenMP stalls on a busy machine."
        ),
    ] = None,
) -> None:
    """AdamW vs Muon vs MuonClip on the same tokens: lr sweep, equal-token losses, max logits, QK-Clip stress.

    Writes OUT/ablation.md, OUT/ablation.json and OUT/ablation.png; each run lives in OUT/runs/ or
    OUT/stress/ and a finished run is reused when the command is repeated (so runs can also be split over
    several processes with --optimizers / --no-stress and gathered by one final full invocation).
    """
    from k2lab.train.ablation import ablation_config, parse_lrs, run_ablation

    settings = ablation_config(
        quick=quick,
        recipe=recipe,
        lrs=parse_lrs(lrs) if lrs is not None else None,
        tau=tau,
        stress_lr=stress_lr,
        stress_tau=stress_tau,
        stress_steps=stress_steps,
        no_stress=no_stress,
        target_loss=target_loss,
        out=out,
        keep_weights=keep_weights,
        optimizers=[name.strip() for name in optimizers.split(",") if name.strip()] if optimizers else None,
        threads=threads,
        jobs=jobs,
        preset=preset,
        steps=steps,
        data=data,
        batch_size=batch_size,
        seq_len=seq_len,
        precision=precision,
    )
    run_ablation(settings, console)


BALANCING_HELP = (
    "No router bias vs the DeepSeek-V3 sign rule vs Quantile Balancing, trained on the same tokens.\n\n"
    "Trains the same recipe once per bias rule (k3-mini, 80 steps × 4×128 tokens of the embedded corpus by "
    "default: ~5 min on 2 CPU cores), with the same seed, data order and lr, and compares the expert load "
    "imbalance (max/mean tokens per expert), the dead experts (no token in a step, or in the last --window "
    "steps) and the final validation loss.\n\n"
    "Writes OUT/balancing.md, OUT/balancing.json and OUT/balancing.png; each run lives in OUT/runs/RULE and "
    "a finished run is reused when the command is repeated."
)


@ablate_app.command("balancing", help=BALANCING_HELP)
def ablate_balancing(
    steps: Annotated[int | None, typer.Option(help="Optimizer steps per run (default 80).")] = None,
    out: Annotated[str | None, typer.Option(help="Output directory (default runs/balancing).")] = None,
    rules: Annotated[
        str | None,
        typer.Option(help="Comma-separated subset of none,deepseek,quantile (default all three)."),
    ] = None,
    data: Annotated[
        str | None, typer.Option(help="Directory of .txt/.md/.jsonl (default: embedded corpus).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed of the initial weights and data order (default 0).")
    ] = None,
    lr: Annotated[
        float | None, typer.Option(help="Peak learning rate of every run (default 2e-3, MuonClip).")
    ] = None,
    gamma: Annotated[
        float | None, typer.Option(help="Bias step γ of the DeepSeek-V3 sign rule (default 1e-3).")
    ] = None,
    window: Annotated[
        int, typer.Option(help="An expert is dead at the end when it got no token in the last N steps.")
    ] = 10,
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", help="Model preset with MoE layers (default k3-mini).")
    ] = None,
    recipe: Annotated[
        Path | None, typer.Option(help="TOML recipe for everything but the bias rule; flags override it.")
    ] = None,
    batch_size: Annotated[int | None, typer.Option(help="Sequences per micro-batch (default 4).")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence (default 128).")] = None,
    precision: Annotated[str | None, typer.Option(help="auto, fp32 or bf16.")] = None,
    keep_weights: KeepWeightsOption = False,
    jobs: Annotated[
        int | None,
        typer.Option(
            help="Runs trained at once, in worker processes (output in OUT/logs/); default one per rule."
        ),
    ] = None,
    threads: ThreadsOption = None,
) -> None:
    from k2lab.train.balancing_ablation import balancing_config, parse_rules, run_balancing

    settings = balancing_config(
        recipe=recipe,
        rules=parse_rules(rules) if rules is not None else None,
        gamma=gamma,
        window=window,
        out=out,
        keep_weights=keep_weights,
        threads=threads,
        jobs=jobs,
        preset=preset,
        steps=steps,
        data=data,
        seed=seed,
        batch_size=batch_size,
        seq_len=seq_len,
        precision=precision,
        **{"optimizer.lr": lr},
    )
    run_balancing(settings, console)


VISION_INJECTION_HELP = (
    "K2.5's vision-injection ablation: early 10:90, mid 20:80 and late 50:50 fusion at a fixed "
    "visual-plus-text token budget.\n\n"
    "Trains the same vision-language recipe once per arm (k25-mini, 200 steps × 8×256 tokens of the embedded "
    "corpus by default, the arms side by side in one-thread worker processes: ~12 min on 2 CPU cores), with "
    "the same seed, text data and lr; vision enters at 0 % / 50 % / 80 % of the steps as 10 % / 20 % / 50 % "
    "of the batch rows, so every arm spends the same 10 % of its rows on vision (checked exactly, to the "
    "row). Compares the final text validation loss and the held-out visual scores per task kind.\n\n"
    "Writes OUT/vision_injection.md, OUT/vision_injection.json and OUT/vision_injection.png; each run lives "
    "in OUT/runs/ARM and a finished run is reused when the command is repeated."
)


@ablate_app.command("vision-injection", help=VISION_INJECTION_HELP)
def ablate_vision_injection(
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", help="Vision-language preset (default k25-mini).")
    ] = None,
    steps: Annotated[
        int | None, typer.Option(help="Optimizer steps per arm, a multiple of 10 (default 200).")
    ] = None,
    batch_size: Annotated[int | None, typer.Option(help="Rows per micro-batch (default 8).")] = None,
    seq_len: Annotated[
        int | None, typer.Option(help="Tokens per row; a visual sample must fit (default 256).")
    ] = None,
    recipe: Annotated[
        Path | None,
        typer.Option(help="TOML recipe for everything but the injection schedule; flags override it."),
    ] = None,
    out: Annotated[str | None, typer.Option(help="Output directory (default runs/vision-injection).")] = None,
    eval_samples: Annotated[
        int | None, typer.Option(help="Held-out visual samples scored per arm (default 60).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed of the initial weights and data order (default 0).")
    ] = None,
    lr: Annotated[
        float | None, typer.Option(help="Peak learning rate of every arm (default 2e-3, MuonClip).")
    ] = None,
    keep_weights: KeepWeightsOption = False,
    jobs: Annotated[
        int | None,
        typer.Option(
            help="Arms trained at once, in worker processes (output in OUT/logs/); default one per arm."
        ),
    ] = None,
    threads: ThreadsOption = None,
) -> None:
    from k2lab.train.vision_ablation import run_vision_injection, vision_injection_config

    settings = vision_injection_config(
        recipe=recipe,
        out=out,
        keep_weights=keep_weights,
        threads=threads,
        jobs=jobs,
        preset=preset,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        **{"optimizer.lr": lr, "vision.eval_samples": eval_samples},
    )
    run_vision_injection(settings, console)


REPHRASE_ABLATION_HELP = (
    "K2's rephrasing ablation at small scale: K rephrasings × 1 epoch vs the raw text × K epochs.\n\n"
    "Takes --docs raw documents (of --data or the embedded corpus, each cut to --doc-chars), rephrases each "
    "K times through an OpenAI-compatible endpoint (--base-url; or k2lab's own server started here over "
    "--checkpoint; or reuses --rephrased DIR), and trains the same recipe (k2-mini, 4×128 tokens per step) on "
    "both arms with the same tokenizer, seed and token budget (K raw epochs). A rephrasing the fidelity check "
    "dropped is replaced by the raw text. Compares the validation loss on raw held-out documents and a cloze "
    "QA probe on facts of the training documents.\n\n"
    "Writes OUT/rephrase.md, OUT/rephrase.json and OUT/rephrase.png; rephrasings are cached in OUT/rephrased "
    "and the runs in OUT/runs/ARM are reused when the command is repeated."
)


@ablate_app.command("rephrase", help=REPHRASE_ABLATION_HELP)
def ablate_rephrase(
    data: Annotated[
        str | None, typer.Option(help="Directory of .txt/.md/.jsonl (default: embedded corpus).")
    ] = None,
    out: Annotated[str | None, typer.Option(help="Output directory (default runs/rephrase).")] = None,
    base_url: Annotated[
        str | None, typer.Option(help="OpenAI-compatible endpoint for the rephrasings, e.g. http://host/v1.")
    ] = None,
    model: Annotated[str | None, typer.Option(help="Model name at --base-url.")] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="OPENAI_API_KEY", help="API key of --base-url ($OPENAI_API_KEY).")
    ] = None,
    checkpoint: Annotated[
        str | None, typer.Option(help="Serve this checkpoint in-process for the rephrasings (no --base-url).")
    ] = None,
    rephrased: Annotated[
        str | None, typer.Option(help="Reuse this `k2lab data rephrase` output instead of rephrasing.")
    ] = None,
    n_rephrasings: Annotated[
        int | None, typer.Option(help="K: rephrasings per document = raw epochs (default 4).")
    ] = None,
    docs: Annotated[int | None, typer.Option(help="Raw training documents (default 32).")] = None,
    doc_chars: Annotated[
        int | None, typer.Option(help="Characters kept per document (default 1000).")
    ] = None,
    heldout_docs: Annotated[int | None, typer.Option(help="Raw held-out documents (default 8).")] = None,
    chunk_chars: Annotated[
        int | None, typer.Option(help="Characters per rephrased chunk (default 400).")
    ] = None,
    styles: Annotated[
        str | None, typer.Option(help="Comma-separated styles (default encyclopedic,textbook,qa,plain).")
    ] = None,
    fidelity_threshold: Annotated[
        float | None, typer.Option(help="Drop rephrasings scoring below this (0-1, default 0.5).")
    ] = None,
    concurrency: Annotated[int | None, typer.Option(help="Requests in flight (default 8).")] = None,
    max_tokens: Annotated[
        int | None, typer.Option(help="Completion tokens per chunk (default ~chars/2).")
    ] = None,
    probe_items: Annotated[int | None, typer.Option(help="QA probe questions (default 64; 0 skips).")] = None,
    steps: Annotated[
        int | None, typer.Option(help="Steps per arm (default: K epochs of the raw subset's tokens).")
    ] = None,
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", help="Model preset (default k2-mini).")
    ] = None,
    vocab_size: Annotated[int | None, typer.Option(help="BPE vocabulary of the shared tokenizer.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Sequences per micro-batch (default 4).")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence (default 128).")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate of both arms.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of weights, data order and sampling.")] = None,
    recipe: Annotated[
        Path | None, typer.Option(help="TOML recipe for everything but the data; flags override it.")
    ] = None,
    keep_weights: KeepWeightsOption = False,
    jobs: Annotated[
        int | None, typer.Option(help="Arms trained at once, in worker processes (default 2).")
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="torch threads per run (default torch's divided among the jobs).")
    ] = None,
) -> None:
    from k2lab.train.rephrase_ablation import rephrase_ablation_config, run_rephrase_ablation

    own = dict(
        data=data, base_url=base_url, model=model, api_key=api_key, checkpoint=checkpoint,
        rephrased=rephrased, n_rephrasings=n_rephrasings, docs=docs, doc_chars=doc_chars,
        heldout_docs=heldout_docs, chunk_chars=chunk_chars, fidelity_threshold=fidelity_threshold,
        concurrency=concurrency, max_tokens=max_tokens, probe_items=probe_items,
        styles=[s.strip() for s in styles.split(",") if s.strip()] if styles else None,
    )  # fmt: skip
    settings = rephrase_ablation_config(
        recipe=recipe, out=out, keep_weights=keep_weights, threads=threads, jobs=jobs, ablation=own,
        preset=preset, vocab_size=vocab_size, batch_size=batch_size, seq_len=seq_len, seed=seed, steps=steps,
        **{"optimizer.lr": lr},
    )  # fmt: skip
    run_rephrase_ablation(settings, console)


data_app = typer.Typer(help="Pre-training data recipes (K2's knowledge rephrasing).", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("rephrase")
def data_rephrase(
    data: Annotated[Path, typer.Option(help="Source corpus: a directory of .txt/.md/.jsonl.")],
    out: Annotated[Path, typer.Option(help="Output corpus directory (texts/, manifest.json).")],
    base_url: Annotated[str, typer.Option(help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.")],
    model: Annotated[str, typer.Option(help="Model name at the endpoint.")],
    api_key: Annotated[
        str | None, typer.Option(envvar="OPENAI_API_KEY", help="API key of the endpoint ($OPENAI_API_KEY).")
    ] = None,
    n_rephrasings: Annotated[int, typer.Option(min=1, help="Rephrasings per document.")] = 2,
    chunk_chars: Annotated[int, typer.Option(min=1, help="Characters per chunk (rewritten in turn).")] = 1500,
    tail_chars: Annotated[
        int, typer.Option(min=0, help="Characters of the rephrased text so far shown with each chunk.")
    ] = 600,
    styles: Annotated[
        str, typer.Option(help="Comma-separated styles, one per rephrasing in turn (names or free text).")
    ] = "encyclopedic,textbook,qa,plain",
    fidelity_threshold: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Drop rephrasings whose fidelity score is below this.")
    ] = 0.5,
    judge: Annotated[
        bool, typer.Option("--judge", help="Also ask the endpoint to rate faithfulness (0-10).")
    ] = False,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight.")] = 4,
    max_tokens: Annotated[
        int | None, typer.Option(min=1, help="Completion tokens per chunk (default ~chunk chars / 2).")
    ] = None,
    temperature: Annotated[float, typer.Option(min=0.0, max=2.0, help="Sampling temperature.")] = 0.7,
    timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 120.0,
    retries: Annotated[int, typer.Option(min=0, help="Retries of a failed request (with backoff).")] = 3,
) -> None:
    """Rewrite a corpus chunk by chunk in diverse styles through an OpenAI-compatible endpoint, verified.

    Each chunk's prompt holds the tail of the rephrased text so far and the next source chunk; a fidelity
    check (content words, names, numbers, length) drops unfaithful rephrasings. Writes OUT/texts/ (a corpus
    directory for `k2lab train --data`) and OUT/manifest.json; documents already done are skipped, and a
    document whose requests keep failing is reported and retried on the next run.
    """
    from k2lab.data.corpus import load_corpus
    from k2lab.data.rephrase import RephraseSettings, rephrase_corpus

    corpus = load_corpus(data, val_fraction=0.0)
    settings = RephraseSettings(
        base_url=base_url, model=model, api_key=api_key, n_rephrasings=n_rephrasings, chunk_chars=chunk_chars,
        tail_chars=tail_chars, styles=tuple(s.strip() for s in styles.split(",") if s.strip()),
        fidelity_threshold=fidelity_threshold, judge=judge, concurrency=concurrency, max_tokens=max_tokens,
        temperature=temperature, timeout=timeout, retries=retries,
    )  # fmt: skip
    console.print(f"rephrasing {len(corpus.train)} documents × {n_rephrasings} through {base_url} → {out}")

    def progress(path: str, entry: dict) -> None:
        if entry["status"] == "failed":
            console.print(f"[red]failed[/] {path}: {entry['error']}", markup=True, highlight=False)
        else:
            scores = ", ".join(f"{r['style']} {r['score']:.2f}{'' if r['kept'] else ' dropped'}"
                               for r in entry["rephrasings"])  # fmt: skip
            console.print(f"done {path}: {scores}", markup=False, highlight=False)

    report = rephrase_corpus(corpus.train, out, settings, on_document=progress)
    console.print(
        f"{report.done} done, {report.skipped} skipped (already done), {report.failed} failed; "
        f"{report.kept} rephrasings kept, {report.dropped} dropped; {report.seconds:.1f}s → {out}"
    )


tools_app = typer.Typer(
    help="Tool specs for the agent data factory, harvested from real MCP servers.", no_args_is_help=True
)
app.add_typer(tools_app, name="tools")


@tools_app.command("harvest")
def tools_harvest(
    config: Annotated[
        Path,
        typer.Option(
            "--config",
            "-c",
            help='servers.json in the Claude Desktop / Cursor layout: {"mcpServers": {"name": {"command": '
            '..., "args": ..., "env": ..., "cwd": ...}}}.',
        ),
    ],
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="JSONL output; the summary goes to OUT's stem + .summary.json."),
    ] = Path("tools.jsonl"),
    timeout: Annotated[
        float, typer.Option(help="Seconds per server for start, initialize and tools/list.")
    ] = 30.0,
    concurrency: Annotated[int, typer.Option(help="Servers harvested at once.")] = 8,
    strict: Annotated[
        bool, typer.Option("--strict", help="Exit with code 1 when any server failed.")
    ] = False,
) -> None:
    """Start the MCP servers of a config, list their tools and write OpenAI-ready normalised specs (JSONL).

    A server that fails to start, crashes, hangs or answers garbage is reported; the others go on.
    The summary is printed and written next to the output (OUT's stem + .summary.json).
    """
    from k2lab.agent.mcp_harvest import harvest, print_summary

    result = harvest(config, timeout=timeout, concurrency=concurrency)
    summary = result.write(out)
    print_summary(result, console)
    console.print(f"wrote {len(result.tools)} tools to {out} (summary: {summary})", highlight=False)
    if strict and result.failed:
        raise typer.Exit(1)


sandbox_app = typer.Typer(help="Run untrusted Python in a contained sandbox.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("run")
def sandbox_run(
    file: Annotated[Path, typer.Argument(help="The Python program to run.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Wall-clock limit in seconds.")] = 10.0,
    memory: Annotated[int, typer.Option("--memory", help="Address-space limit in MB.")] = 512,
    cpu: Annotated[
        float | None, typer.Option("--cpu", help="CPU-time limit in seconds (default: the timeout).")
    ] = None,
    max_output: Annotated[
        int, typer.Option("--max-output", help="Bytes kept of stdout and of stderr; more kills the run.")
    ] = 1_000_000,
    workdir: Annotated[
        Path | None, typer.Option("--workdir", help="Writable working directory (default: a fresh temp dir).")
    ] = None,
) -> None:
    """Run FILE in the sandbox and print the JSON result (exit code 0 whenever the sandbox ran).

    The program gets its own network, mount and PID namespaces, a read-only filesystem except its working
    directory, an unprivileged uid, resource limits, and nothing of it survives the run; the result's
    `isolation` says what was actually contained on this machine.
    """
    from k2lab.agent.sandbox import SandboxLimits, run_python

    if not file.is_file():
        raise K2LabError(f"cannot run {file}: it does not exist or is not a file")
    if timeout <= 0 or memory <= 0 or max_output <= 0 or (cpu is not None and cpu <= 0):
        raise K2LabError("--timeout, --memory, --cpu and --max-output must be positive")
    limits = SandboxLimits(timeout_s=timeout, cpu_s=cpu, memory_mb=memory, max_output_bytes=max_output)
    result = run_python(file, limits, workdir=workdir)
    print(json.dumps(result.to_dict(), indent=2))


@app.command()
def rl(
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", "-c", help="k2lab model directory with tokenizer.json.")
    ],
    out: Annotated[Path, typer.Option(help="Run directory (metrics, checkpoints, final model).")],
    iterations: Annotated[int, typer.Option(min=1, help="RL iterations.")] = 10,
    group: Annotated[int, typer.Option(min=2, help="K responses per prompt.")] = 4,
    prompts: Annotated[int, typer.Option(min=1, help="New prompts (groups) per iteration.")] = 2,
    envs: Annotated[
        str, typer.Option(help="Comma-separated: arithmetic, instruction, coding, open_qa, tools.")
    ] = "arithmetic,instruction,coding",
    env_weights: Annotated[
        str | None, typer.Option(help="Comma-separated mixture weights, one per environment.")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens per assistant turn.")] = 64,
    token_limit: Annotated[
        int | None, typer.Option(min=1, help="Tokens per episode per iteration (partial rollouts).")
    ] = None,
    temperature: Annotated[float, typer.Option(help="Starting temperature T_0.")] = 1.0,
    temperature_floor: Annotated[float, typer.Option(help="Temperature floor.")] = 0.3,
    temperature_decay: Annotated[float, typer.Option(help="γ in T_i = max(floor, T_0 γ^i).")] = 0.9,
    tau: Annotated[float, typer.Option(help="τ of the K1.5 objective.")] = 0.5,
    offpolicy_clip: Annotated[
        float | None, typer.Option(help="K2.5 token-level clip δ on |log π_θ − log π_old|.")
    ] = None,
    budget_penalty: Annotated[float, typer.Option(help="λ of the token-budget penalty.")] = 0.1,
    updates: Annotated[int, typer.Option(min=1, help="Optimizer steps per iteration.")] = 2,
    lr: Annotated[float, typer.Option(help="MuonClip learning rate.")] = 1e-3,
    ptx_data: Annotated[str | None, typer.Option(help="PTX corpus directory.")] = None,
    ptx_weight: Annotated[float, typer.Option(help="α of the PTX loss (0: off).")] = 0.0,
    critic: Annotated[
        str, typer.Option(help='Rubric critic: "none", "self" (a copy of the policy) or a checkpoint.')
    ] = "none",
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Checkpoint every N iterations.")] = 1,
    seed: Annotated[int, typer.Option(help="Run seed (tasks and sampling).")] = 0,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")] = None,
    resume: Annotated[
        bool, typer.Option("--resume/--no-resume", help="Continue from OUT/checkpoints when present.")
    ] = True,
) -> None:
    """Joint RL (K2): verifiable environments + rubric critic, K1.5's objective, MuonClip, exact resume."""
    from k2lab.agentic.rl import RLConfig, run_rl
    from k2lab.optim.grouping import OptimizerConfig

    config = RLConfig(
        iterations=iterations,
        group_size=group,
        groups_per_iteration=prompts,
        envs=[name.strip() for name in envs.split(",") if name.strip()],
        env_weights=[float(w) for w in env_weights.split(",")] if env_weights else None,
        max_new_tokens=max_new_tokens,
        token_limit=token_limit,
        temperature_start=temperature,
        temperature_floor=temperature_floor,
        temperature_decay=temperature_decay,
        tau=tau,
        offpolicy_clip=offpolicy_clip,
        budget_penalty=budget_penalty,
        updates_per_iteration=updates,
        ptx_data=ptx_data,
        ptx_weight=ptx_weight,
        critic=critic,
        optimizer=OptimizerConfig(lr=lr),
        checkpoint_every=checkpoint_every,
        seed=seed,
    )
    try:
        history = run_rl(checkpoint, out, config, resume=resume, threads=threads)
    except ValueError as error:
        raise K2LabError(str(error)) from error
    last = history[-1] if history else {}
    console.print(
        f"RL done: {len(history)} iterations this run, last mean reward {last.get('mean_reward')}, "
        f"metrics in {out / 'metrics.jsonl'}, policy in {out / 'model'}"
    )


factory_app = typer.Typer(
    help="K2's agentic data factory: tool tasks rolled out by expert agents, judged by rubrics.",
    no_args_is_help=True,
)
app.add_typer(factory_app, name="factory")


@factory_app.command("generate")
def factory_generate(
    n: Annotated[int, typer.Option("--n", help="Tasks to roll out.")] = 100,
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="Kept trajectories (JSONL); summary: OUT's stem + .summary.json."),
    ] = Path("trajectories.jsonl"),
    seed: Annotated[int, typer.Option("--seed", help="Seed of the tool evolution, tasks and failures.")] = 0,
    tools: Annotated[
        Path | None, typer.Option("--tools", help="Harvested MCP tools (JSONL of `k2lab tools harvest`).")
    ] = None,
    failure_rate: Annotated[
        float,
        typer.Option("--failure-rate", help="Injected failures per call (errors, rate limits, edge cases)."),
    ] = 0.1,
    imperfection: Annotated[
        float, typer.Option("--imperfection", help="Share of tasks where the expert makes one mistake.")
    ] = 0.2,
    no_tool_fraction: Annotated[
        float, typer.Option("--no-tool-fraction", help="Share of tasks that need no tool at all.")
    ] = 0.15,
    mcp_fraction: Annotated[
        float, typer.Option("--mcp-fraction", help="Share of tasks for harvested MCP tools (with --tools).")
    ] = 0.2,
    variants_per_tool: Annotated[
        int,
        typer.Option(
            "--variants-per-tool",
            min=0,
            help="Evolved variants of every base tool (0: canonical names only).",
        ),
    ] = 12,
    max_distractors: Annotated[
        int, typer.Option("--max-distractors", min=0, help="Tools of other domains an agent may also hold.")
    ] = 2,
) -> None:
    """Roll out N tool tasks with expert agents, judge them by rubric, write the kept conversations (JSONL).

    Runs on CPU without an external model: synthetic tools evolved over a domain hierarchy (plus harvested
    MCP tools with --tools), a stateful simulator injecting failures, scripted users and procedural experts
    (imperfect on a share of tasks, so the judge has trajectories to reject).
    """
    from k2lab.agentic.factory import FactoryConfig, generate, print_summary

    if tools is not None and not tools.is_file():
        raise K2LabError(f"--tools {tools}: no such file")
    config = FactoryConfig(
        n,
        seed,
        tools,
        failure_rate,
        imperfection,
        no_tool_fraction,
        mcp_fraction,
        variants_per_tool,
        max_distractors,
    )
    result = generate(config)
    summary = result.write(out)
    print_summary(result.summary, console)
    console.print(f"wrote {len(result.kept)} trajectories to {out} (summary: {summary})", highlight=False)


recipe_app = typer.Typer(help="End-to-end recipes that chain k2lab's stages.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("agentic-mini")
def recipe_agentic_mini(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Run directory (one subdirectory per stage).")
    ] = Path("runs/agentic-mini"),
    base: Annotated[
        Path | None, typer.Option("--base", help="Trained k2lab model dir (tokenizer.json); else pre-train.")
    ] = None,
    pretrain_steps: Annotated[
        int | None, typer.Option(min=1, help="Pre-training steps without --base (default 250).")
    ] = None,
    factory_n: Annotated[
        int | None, typer.Option(min=1, help="Factory tasks rolled out for SFT data (default 1500).")
    ] = None,
    sft_steps: Annotated[int | None, typer.Option(min=1, help="SFT optimizer steps (default 240).")] = None,
    rl_iterations: Annotated[int | None, typer.Option(min=1, help="RL iterations (default 12).")] = None,
    rl_groups: Annotated[
        int | None, typer.Option(min=1, help="RL prompts per iteration (default 4).")
    ] = None,
    rl_group_size: Annotated[
        int | None, typer.Option(min=2, help="RL samples per prompt (K) (default 4).")
    ] = None,
    credit: Annotated[
        str | None,
        typer.Option(
            help="RL partial credit of a failed task: 'progress' (planned calls graded by their arguments, "
            "the answer's key facts; default) or 'checks' (fraction of rubric checks met)."
        ),
    ] = None,
    partial_credit: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="RL reward of a failed task = this x its credit (default 0.5; 0: reward for success only).",
        ),
    ] = None,
    rl_no_tool_fraction: Annotated[
        float | None,
        typer.Option(min=0.0, max=1.0, help="Share of RL prompts that need no tool (default 0.6)."),
    ] = None,
    eval_n: Annotated[
        int | None, typer.Option(min=1, help="Held-out evaluation tasks (default 200).")
    ] = None,
    no_tool_eval_n: Annotated[
        int | None,
        typer.Option(min=0, help="Held-out tasks that need no tool, for the tool-call probe (default 300)."),
    ] = None,
    eval_seed: Annotated[
        int | None, typer.Option(help="Factory seed of the held-out tasks, unused in training (default 7).")
    ] = None,
    eval_batch_size: Annotated[
        int | None, typer.Option(min=1, help="Rows per batched generate call (default 32).")
    ] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")] = None,
) -> None:
    """Pre-trained mini model -> factory data -> SFT -> RL -> held-out evaluation (CPU, ~25 min).

    Every stage is reused when complete, so a killed run resumes. Writes report.json, report.md and
    agentic_mini.png in OUT.
    """
    from k2lab.agentic.recipe import RecipeConfig, print_report, run_recipe

    chosen = {
        "pretrain_steps": pretrain_steps,
        "factory_n": factory_n,
        "sft_steps": sft_steps,
        "rl_iterations": rl_iterations,
        "rl_groups": rl_groups,
        "rl_group_size": rl_group_size,
        "credit": credit,
        "partial_credit": partial_credit,
        "rl_no_tool_fraction": rl_no_tool_fraction,
        "eval_n": eval_n,
        "no_tool_eval_n": no_tool_eval_n,
        "eval_seed": eval_seed,
        "eval_batch_size": eval_batch_size,
    }
    config = RecipeConfig(
        out=out, base=base, threads=threads, **{k: v for k, v in chosen.items() if v is not None}
    )
    try:
        report = run_recipe(config, log=lambda text: console.print(text, highlight=False, markup=False))
    except ValueError as error:
        raise K2LabError(str(error)) from error
    print_report(report, console)
    console.print(f"reports: {out / 'report.md'}, {out / 'report.json'}, {out / 'agentic_mini.png'}")


mopd_app = typer.Typer(
    help="K3's multi-effort RL (3 domains x 3 effort levels = 9 experts) merged by multi-teacher "
    "on-policy distillation.",
    no_args_is_help=True,
)
app.add_typer(mopd_app, name="mopd")


def _mopd_budgets(text: str) -> dict[str, int]:
    from k2lab.agentic.effort import EFFORTS

    values = [int(x) for x in text.split(",") if x.strip()]
    if len(values) != len(EFFORTS):
        raise K2LabError(f"--budgets needs {len(EFFORTS)} comma-separated token budgets (low,high,max)")
    return dict(zip(EFFORTS, values, strict=True))


@mopd_app.command("experts")
def mopd_experts(
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", "-c", help="SFT model directory with tokenizer.json.")
    ],
    out: Annotated[Path, typer.Option(help="Experts directory (one RL run per domain-effort).")],
    iterations: Annotated[int, typer.Option(min=1, help="RL iterations per expert.")] = 10,
    domains: Annotated[
        str, typer.Option(help="Comma-separated environments.")
    ] = "arithmetic,instruction,coding",
    budgets: Annotated[str, typer.Option(help="Token budgets of low,high,max effort.")] = "16,48,128",
    group: Annotated[int, typer.Option(min=2, help="K responses per prompt.")] = 4,
    prompts: Annotated[int, typer.Option(min=1, help="New prompts per iteration.")] = 2,
    updates: Annotated[int, typer.Option(min=1, help="Optimizer steps per iteration.")] = 2,
    budget_penalty: Annotated[float, typer.Option(help="λ of the token-budget penalty.")] = 0.1,
    lr: Annotated[float, typer.Option(help="MuonClip learning rate.")] = 1e-3,
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature of the first iteration (decays by 0.9 to 0.3).")
    ] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of the first expert (expert i uses seed + i).")] = 0,
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Checkpoint every N iterations.")] = 1,
    keep_checkpoints: Annotated[int, typer.Option(min=1, help="Checkpoints kept per expert.")] = 2,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")] = None,
) -> None:
    """Train the nine effort experts by RL from one SFT checkpoint (skips finished ones, resumes the rest)."""
    import torch

    from k2lab.agentic.effort import expert_specs, train_experts
    from k2lab.agentic.rl import RLConfig
    from k2lab.optim.grouping import OptimizerConfig

    if threads is not None:
        torch.set_num_threads(threads)
    specs = expert_specs([d.strip() for d in domains.split(",") if d.strip()], _mopd_budgets(budgets))
    config = RLConfig(
        iterations=iterations,
        group_size=group,
        groups_per_iteration=prompts,
        updates_per_iteration=updates,
        budget_penalty=budget_penalty,
        temperature_start=temperature,
        optimizer=OptimizerConfig(lr=lr),
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        seed=seed,
    )
    train_experts(checkpoint, out, config, specs, log=lambda text: console.print(text, highlight=False))
    console.print(f"experts: {out / 'experts.json'}")


@mopd_app.command("distill")
def mopd_distill(
    experts: Annotated[Path, typer.Option(help="Experts directory from `k2lab mopd experts`.")],
    student: Annotated[Path, typer.Option(help="Student's starting model (the SFT checkpoint).")],
    out: Annotated[Path, typer.Option(help="Run directory (metrics, checkpoints, OUT/model).")],
    steps: Annotated[int, typer.Option(min=1, help="Distillation steps.")] = 20,
    prompts: Annotated[int, typer.Option(min=1, help="Prompts per step (cells round-robin).")] = 9,
    temperature: Annotated[float, typer.Option(help="Student sampling temperature.")] = 1.0,
    objective: Annotated[
        str,
        typer.Option(
            help="'dense': the per-token KL(student || teacher) over the whole next-token distribution, the "
            "exact expectation of the log-ratio reward (no sampling noise, [tokens, vocab] memory); "
            "'sampled': the reward log pi_teacher - log pi_student of the sampled token (K3's estimator)."
        ),
    ] = "dense",
    lr: Annotated[float, typer.Option(help="MuonClip learning rate.")] = 2e-4,
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Checkpoint every N steps.")] = 1,
    keep_checkpoints: Annotated[int, typer.Option(min=1, help="Checkpoints kept.")] = 3,
    seed: Annotated[int, typer.Option(help="Run seed (prompts and sampling).")] = 0,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")] = None,
) -> None:
    """Multi-teacher on-policy distillation: per-token reward log π_teacher − log π_student (exact resume)."""
    import torch

    from k2lab.agentic.mopd import MOPDConfig, run_mopd
    from k2lab.optim.grouping import OptimizerConfig

    if threads is not None:
        torch.set_num_threads(threads)
    config = MOPDConfig(
        steps=steps,
        prompts_per_step=prompts,
        temperature=temperature,
        objective=objective,
        optimizer=OptimizerConfig(lr=lr),
        checkpoint_every=checkpoint_every,
        keep_checkpoints=keep_checkpoints,
        seed=seed,
    )

    def show(m: dict) -> None:
        console.print(
            f"step {m['step']}: loss {m['loss']} reverse KL {m['reverse_kl']} reward {m['mean_reward']} "
            f"tokens {m['trained_tokens']} ({m['seconds']} s)",
            highlight=False,
        )

    run_mopd(experts, student, out, config, on_step=show)
    console.print(f"student: {out / 'model'}")


@mopd_app.command("report")
def mopd_report_command(
    experts: Annotated[Path, typer.Option(help="Experts directory.")],
    distill: Annotated[Path, typer.Option(help="Distillation run directory.")],
    out: Annotated[Path | None, typer.Option(help="Report directory (default DISTILL/report).")] = None,
    episodes: Annotated[int, typer.Option(min=1, help="Held-out prompts per cell.")] = 4,
    baseline_steps: Annotated[
        int | None, typer.Option(min=1, help="SFT-baseline steps (default: the distillation's).")
    ] = None,
    temperature: Annotated[float, typer.Option(help="Evaluation temperature (0 = greedy).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Held-out seed namespace.")] = 1,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")] = None,
) -> None:
    """Per cell: MOPD student vs its teacher (goal ≥ 90 %) and vs an SFT-on-teacher-samples baseline."""
    import torch

    from k2lab.agentic.mopd import markdown_table, mopd_report

    if threads is not None:
        torch.set_num_threads(threads)
    report = mopd_report(
        experts, distill, out, episodes, baseline_steps, temperature, seed,
        log=lambda text: console.print(text, highlight=False),
    )  # fmt: skip
    console.print(markdown_table(report["cells"]), highlight=False)
    console.print(f"goal met on {report['cells_met']}/{len(report['cells'])} cells")
    target = out or distill / "report"
    console.print(f"reports: {target / 'report.md'}, {target / 'report.json'}, {target / 'report.png'}")


PARL_ABLATION_HELP = (
    "PARL's reward terms on wide tasks (K2.5 Agent Swarm): full reward vs without r_parallel vs without "
    "r_finish vs a single agent without sub-agents.\n\n"
    "Trains the compact orchestrator (a factorised categorical policy over orchestration actions) with "
    "frozen procedural sub-agents for each arm and seed (~1 min on 2 CPU cores by default) and compares "
    "held-out success, CriticalSteps, total tokens (cost) and training iterations to a target success.\n\n"
    "Writes OUT/parl.md, OUT/parl.json and OUT/parl.png; runs live in OUT/runs/ARM/seedS and resume or are "
    "reused when the command is repeated."
)


@ablate_app.command("parl", help=PARL_ABLATION_HELP)
def ablate_parl(
    out: Annotated[str, typer.Option(help="Output directory.")] = "runs/parl",
    iterations: Annotated[int | None, typer.Option(help="Training iterations per run (default 40).")] = None,
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds (tasks, sampling).")] = "0,1,2",
    arms: Annotated[
        str | None, typer.Option(help="Comma-separated subset of full,no_parallel,no_finish,single_agent.")
    ] = None,
    target: Annotated[float, typer.Option(help="Held-out success for 'time to target'.")] = 0.9,
    eval_tasks: Annotated[
        int | None, typer.Option(help="Held-out tasks per evaluation (default 32).")
    ] = None,
    solo_prior: Annotated[
        float | None, typer.Option(help="Initial logit of working alone (single-agent start, default 4.5).")
    ] = None,
    max_turns: Annotated[
        int | None,
        typer.Option(
            min=2,
            help="B_main, orchestrator turns per episode (default 3: wide tasks are serially impossible; "
            "above max shards + 1 every task is serially solvable).",
        ),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Smoke run: 4 iterations, 1 seed, 8 tasks.")] = False,
    threads: Annotated[int, typer.Option(help="torch threads.")] = 1,
) -> None:
    from k2lab.swarm.ablation import ARMS, ParlAblationSettings, run_parl_ablation
    from k2lab.swarm.parl import ParlConfig

    base: dict[str, object] = {"iterations": 4, "eval_tasks": 8, "group_size": 4} if quick else {}
    chosen = {
        "iterations": iterations, "eval_tasks": eval_tasks, "solo_prior": solo_prior, "max_turns": max_turns,
    }  # fmt: skip
    base.update({k: v for k, v in chosen.items() if v is not None})
    seed_list = [int(s) for s in seeds.split(",") if s.strip()][: 1 if quick else None]
    settings = ParlAblationSettings(
        out=out, base=ParlConfig(**base), seeds=seed_list, target=target, threads=threads,
        arms=[a.strip() for a in arms.split(",") if a.strip()] if arms else list(ARMS),
    )  # fmt: skip
    run_parl_ablation(settings, console)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning user errors into one paragraph and exit code 2."""
    err = Console(stderr=True)
    try:
        app(args=argv)  # click reports usage errors itself (exit code 2)
    except K2LabError as error:
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        sys.exit(2)
    except ValidationError as error:
        err.print(f"[bold red]invalid value:[/] {format_validation_error(error)}", highlight=False)
        sys.exit(2)
