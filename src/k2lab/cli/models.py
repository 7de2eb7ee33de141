"""Model commands: ``presets``, ``params``, ``init``, ``export``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from k2lab.cli.app import PresetOption, app, console
from k2lab.cli.options import Opt, runs_config
from k2lab.errors import K2LabError
from k2lab.hf import export as hf_export
from k2lab.presets import available_presets, get_preset, language_model_config, load_preset


@app.command()
def presets() -> None:
    """List the model presets with their parameter counts (text, then vision-language)."""
    from k2lab.params import count_parameters, humanize

    table = Table(title="k2lab presets")
    for column in ("preset", "layers (MLA / KDA)", "hidden", "experts (top-k)", "total", "active"):
        # the name whole (it is what --preset takes): narrow terminals wrap the other columns instead
        table.add_column(
            column, justify="left" if column == "preset" else "right", no_wrap=column == "preset"
        )
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
    from k2lab.presets.vision_language import load_vlm_preset, vlm_parameter_counts

    table = Table(title="vision-language presets (train with --preset NAME)")
    for column in ("preset", "language model", "tower", "tower params", "projector", "total"):
        table.add_column(
            column,
            justify="left" if column in ("preset", "language model", "tower") else "right",
            no_wrap=column in ("preset", "language model"),
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
    from k2lab.presets.vision_language import load_vlm_preset, vlm_parameter_counts

    report = count_parameters(language_model_config(preset))
    vision = vlm_parameter_counts(load_vlm_preset(preset)) if get_preset(preset).is_vision_language else None
    if as_json:
        counts = report.to_dict()
        if vision:  # the preset asked for, its language model's beside it
            counts |= {"preset": preset, "language_model": report.preset, "vision_language": vision}
        print(json.dumps(counts))
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


def is_earlier_init(directory: Path) -> bool:
    """Whether ``directory`` is a model ``init`` may replace: one it could have written (no tokenizer.json; not
    a run's model/). ``init -o runs/a/model`` replaced a trained model with random weights and deleted its
    tokenizer."""
    from k2lab.fsutil import is_model_directory
    from k2lab.train.run_directory import is_run_directory

    trained = (directory / "tokenizer.json").exists() or is_run_directory(directory.parent)
    return is_model_directory(directory) and not trained


@app.command()
def init(
    preset: PresetOption,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the checkpoint to.")],
    seed: Annotated[int, typer.Option(help="Random seed for the initial weights.")] = 0,
    hf: Annotated[
        bool,
        typer.Option("--hf", help="Write Hugging Face format instead (DeepseekV3, Kimi Linear or kimi_k3)."),
    ] = False,
) -> None:
    """Write a randomly initialised checkpoint of a preset (k2lab format, or HF format with --hf)."""
    from k2lab.fsutil import check_replaceable
    from k2lab.model_dir import save_model
    from k2lab.models import build_model
    from k2lab.params import count_parameters

    config = load_preset(preset)
    total = count_parameters(config).total
    if total > 2e9:
        raise K2LabError(
            f"preset {preset!r} has {total:,} parameters; `init` materialises weights in memory, which this "
            "command refuses above 2B. Use `k2lab params` to inspect large presets."
        )
    check_replaceable(out, "a checkpoint", earlier=is_earlier_init, kind="`k2lab init` checkpoint")
    model = build_model(config, seed=seed)
    if hf:
        from k2lab.hf import to_hf

        to_hf(model, out)
    else:
        save_model(model, out)
    console.print(f"wrote {preset} ({total:,} parameters, seed {seed}) to {out}", soft_wrap=True)


@app.command()
@runs_config(
    hf_export.ExportConfig,
    options={
        "out": Opt("out", "-o"),
        "format": Opt("format"),
        "max_shard_size": Opt("max_shard_size"),
        "dtype": Opt("dtype"),
        "checkpoint": Opt("checkpoint"),
        "tokenizer": Opt("tokenizer"),
        "quantize": Opt("quantize"),
    },
)
def export(
    config: hf_export.ExportConfig,
    source: Annotated[
        Path,
        typer.Argument(
            help="A run directory (its final model or latest / best checkpoint), a training checkpoint "
            "(RUN/checkpoints/step_*) or a model directory."
        ),
    ],
) -> None:
    """Write a complete Hugging Face model repository: config, safetensors (sharded), tokenizer files with the
    special tokens, the chat template and generation_config.json. A DeepseekV3 / Kimi-K2 / Kimi Linear (or
    K2.5 vision-language) export loads in transformers and vLLM; a kimi_k3 one (a model with K3's features)
    in vLLM and mlx-lm, not transformers.
    --quantize mxfp4 stores the routed experts as compressed-tensors MXFP4 (Kimi K3's format), --quantize fp8
    a DeepseekV3 / Kimi-K2 model as block FP8 (the DeepSeek-V3 / Kimi-K2 release format)."""
    out = hf_export.export(
        config, source, log=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True)
    )
    files = sorted(path.name for path in out.iterdir()) if out.is_dir() else [out.name]  # gguf: one file
    console.print(f"wrote {out}: {', '.join(files)}", markup=False, highlight=False, soft_wrap=True)
