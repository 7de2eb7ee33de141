"""The ``ablate`` group: optimizer, balancing, k3-design, vision-injection, zero-vision, rephrase and PARL
studies.

Each command runs the settings model of its study (``k2lab.ablations``): ``--recipe FILE.toml`` (the study's
settings with a ``[base]`` table, or a training recipe alone for ``base``), repeatable ``--set key.path=value``
and named options derived from the settings, so each default lives in the study's module and ``--help``
reads it from there; ``--quick`` applies the study's ``QUICK`` overlay below all of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer
from pydantic import BaseModel

from k2lab.ablations import balancing, k3_design, optimizer, parl, rephrase, vision_injection, zero_vision
from k2lab.ablations.common import load_settings
from k2lab.cli.app import app, console
from k2lab.cli.options import Opt, Profile, runs_config

ablate_app = typer.Typer(
    help="Ablations that train several runs on the same tokens and compare them.", no_args_is_help=True
)


app.add_typer(ablate_app, name="ablate")


def _value_at(settings: BaseModel, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def study_command(
    settings: type[BaseModel],
    options: Mapping[str, Opt],
    profiles: Mapping[str, Profile] | None = None,
    derived: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``runs_config`` for a study: its settings loader, and the defaults ``--help`` shows read from the
    settings the command runs with no options (the study's base recipe included); ``derived`` names the
    fields (dotted paths) the study works out itself when they are unset, with what ``--help`` shows."""
    load = functools.partial(load_settings, settings)
    default = load()
    shown = {option.path: _value_at(default, option.path) for option in options.values()}
    shown |= derived or {}
    return runs_config(settings, options=options, load=load, defaults=shown, profiles=profiles)


# options every training study has
RUN_OPTIONS = {
    "keep_weights": Opt("keep_weights"),
    "jobs": Opt("jobs"),
    "threads": Opt("threads"),
}
# options of the base training recipe: name -> (field under ``base``, help)
BASE_OPTIONS = {
    "preset": ("preset", "Model preset"),
    "steps": ("steps", "Optimizer steps per run"),
    "data": ("data", None),
    "vocab_size": ("vocab_size", "BPE vocabulary of the shared tokenizer"),
    "batch_size": ("batch_size", "Sequences per micro-batch"),
    "seq_len": ("seq_len", "Tokens per sequence"),
    "precision": ("precision", "Model-step precision"),
    "seed": ("seed", "Seed of the initial weights and data order"),
    "lr": ("optimizer.lr", "Peak learning rate of every run"),
}


def base_options(*names: str, **helps: str) -> dict[str, Opt]:
    """Named options for fields of the study's base recipe (``base.…``), with a study's own help texts."""
    return {
        name: Opt(f"base.{BASE_OPTIONS[name][0]}", *(("-p",) if name == "preset" else ()),
                  help=helps.get(name, BASE_OPTIONS[name][1]))
        for name in names
    }  # fmt: skip


def _sized(base: Mapping[str, Any]) -> str:
    return f"{base['preset']}, {base['steps']} steps × {base['batch_size']}×{base['seq_len']} tokens"


_QUICK = optimizer.QUICK["base"]
OPTIMIZER_QUICK = Profile(
    optimizer.QUICK,
    help=f"Smoke run: {_QUICK['preset']}, {_QUICK['data_max_bytes'] // 10**6} MB of the corpus, "
    f"{_QUICK['steps']} steps (~2 min).",
)


@ablate_app.command("optimizer")
@study_command(
    optimizer.AblationConfig,
    profiles={"quick": OPTIMIZER_QUICK},
    options={
        **base_options("preset", "steps"),
        "out": Opt("out"),
        "lrs": Opt("lrs"),
        **base_options("data"),
        "tau": Opt("tau"),
        "stress_lr": Opt("stress.lr"),
        "stress_tau": Opt("stress.tau"),
        "stress_steps": Opt("stress.steps"),
        "target_loss": Opt("target_loss"),
        **base_options("batch_size", "seq_len", "precision"),
        "optimizers": Opt("optimizers"),
        **RUN_OPTIONS,
    },
)
def ablate_optimizer(
    config: optimizer.AblationConfig,
    no_stress: Annotated[bool, typer.Option("--no-stress", help="Skip the stress setting.")] = False,
) -> None:
    """AdamW vs Muon vs MuonClip on the same tokens: lr sweep, equal-token losses, max logits, QK-Clip stress.

    Writes OUT/ablation.md, OUT/ablation.json and OUT/ablation.png; each run lives in OUT/runs/ or
    OUT/stress/ and a finished run is reused when the command is repeated (so runs can also be split over
    several processes with --optimizers / --no-stress and gathered by one final full invocation).
    """
    if no_stress:
        config = config.model_copy(update={"stress": None})
    optimizer.run_ablation(config, console)


BALANCING_HELP = (
    "No router bias vs the DeepSeek-V3 sign rule vs Quantile Balancing, trained on the same tokens.\n\n"
    f"Trains the same recipe once per bias rule ({_sized(balancing.BalancingConfig.BASE)} of the embedded "
    "corpus by default: ~5 min on 2 CPU cores), with the same seed, data order and lr, and compares the "
    "expert load imbalance (max/mean tokens per expert), the dead experts (no token in a step, or in the last "
    "--window steps) and the final validation loss.\n\n"
    "Writes OUT/balancing.md, OUT/balancing.json and OUT/balancing.png; each run lives in OUT/runs/RULE and "
    "a finished run is reused when the command is repeated."
)


@ablate_app.command("balancing", help=BALANCING_HELP)
@study_command(
    balancing.BalancingConfig,
    options={
        **base_options("steps"),
        "out": Opt("out"),
        "rules": Opt("rules"),
        **base_options("data", "seed", "lr"),
        "gamma": Opt("gamma"),
        "window": Opt("window"),
        **base_options("preset", "batch_size", "seq_len", "precision", preset="Model preset with MoE layers"),
        **RUN_OPTIONS,
    },
)
def ablate_balancing(config: balancing.BalancingConfig) -> None:
    balancing.run_balancing(config, console)


K3_DESIGN_HELP = (
    "K3's architecture claims at small scale: the K3 preset vs plain residuals (no AttnRes) vs SwiGLU "
    "without the latent RMSNorm (unstable LatentMoE) vs every layer MLA with RoPE (no KDA), trained on the "
    "same tokens.\n\n"
    f"Trains the same recipe once per arm ({_sized(k3_design.K3DesignConfig.BASE)} of the embedded corpus by "
    "default, two arms at a time in one-thread worker processes: ~9 min on 2 CPU cores), with the same "
    "seed, data order and lr, and compares the validation loss curve, training tokens/s, parameters (total / "
    "active), the max |u| of the latent routed sum and of the MoE output on the validation batches, and the "
    "gradient-norm maxima and spikes; one verdict sentence per claim.\n\n"
    "Writes OUT/k3_design.md, OUT/k3_design.json and OUT/k3_design.png; each run lives in OUT/runs/ARM and a "
    "finished run is reused when the command is repeated."
)


@ablate_app.command("k3-design", help=K3_DESIGN_HELP)
@study_command(
    k3_design.K3DesignConfig,
    options={
        **base_options("steps"),
        "out": Opt("out"),
        "arms": Opt("arms"),
        **base_options("data", "seed", "lr"),
        "spike_factor": Opt("spike_factor"),
        "spike_window": Opt("spike_window"),
        **base_options("preset", "batch_size", "seq_len", "precision", preset="K3-family model preset"),
        **RUN_OPTIONS,
    },
    derived={"jobs": "2 (1 for one arm)"},
)
def ablate_k3_design(config: k3_design.K3DesignConfig) -> None:
    k3_design.run_k3_design(config, console)


_ARMS = vision_injection.ARMS.values()
VISION_INJECTION_HELP = (
    "K2.5's vision-injection ablation: early 10:90, mid 20:80 and late 50:50 fusion at a fixed "
    "visual-plus-text token budget.\n\n"
    f"Trains the same vision-language recipe once per arm ({_sized(vision_injection.VisionInjectionConfig.BASE)} "
    "of the embedded corpus by default, the arms side by side in one-thread worker processes: ~12 min on 2 CPU "
    "cores), with the same seed, text data and lr; vision enters at "
    + " / ".join(f"{start:.0%}" for start, _ in _ARMS)
    + " of the steps as "
    + " / ".join(f"{ratio:.0%}" for _, ratio in _ARMS)
    + " of the batch rows, so every arm spends the same 10 % of its rows on vision (checked exactly, to the "
    "row). Compares the final text validation loss and the held-out visual scores per task kind.\n\n"
    "Writes OUT/vision_injection.md, OUT/vision_injection.json and OUT/vision_injection.png; each run lives "
    "in OUT/runs/ARM and a finished run is reused when the command is repeated."
)


@ablate_app.command("vision-injection", help=VISION_INJECTION_HELP)
@study_command(
    vision_injection.VisionInjectionConfig,
    options={
        **base_options(
            "preset",
            "steps",
            "batch_size",
            "seq_len",
            preset="Vision-language preset",
            steps="Optimizer steps per arm, a multiple of 10",
            batch_size="Rows per micro-batch",
            seq_len="Tokens per row; a visual sample must fit",
        ),
        "out": Opt("out"),
        "eval_samples": Opt("base.vision.eval_samples", help="Held-out visual samples scored per arm"),
        **base_options("seed", "lr", lr="Peak learning rate of every arm"),
        **RUN_OPTIONS,
    },
)
def ablate_vision_injection(config: vision_injection.VisionInjectionConfig) -> None:
    vision_injection.run_vision_injection(config, console)


ZERO_VISION_HELP = (
    "K2.5's zero-vision SFT: text-only SFT vs text-vision SFT from the same joint pre-trained model, then "
    "visual RL from each.\n\n"
    "Starts from --base-checkpoint (a vision-language model directory with tokenizer.json) or pre-trains one "
    "(K2.5's early 10:90 recipe, k25-mini 200 steps, ~7 min) in OUT/runs/pretrain; writes --count zero-vision "
    "trajectories (programs over scenes given as text); trains two SFT arms with the same steps, rows, lr and "
    "seed, one on the trajectories only and one with --visual-ratio of its rows hand-designed visual "
    "trajectories (rows long enough for the longest trajectory unless --seq-len); scores held-out visual tasks "
    "asked in chat, with images and with gray ones, for both arms and the base; then runs --rl-iterations of "
    "visual RL from each arm (~8 min in all on 2 CPU cores from a k25-mini base).\n\n"
    "Writes OUT/zero_vision.md, OUT/zero_vision.json and OUT/zero_vision.png; runs live in OUT/runs/NAME and "
    "are reused when the command is repeated with the same settings."
)


@ablate_app.command("zero-vision", help=ZERO_VISION_HELP)
@study_command(
    zero_vision.ZeroVisionSettings,
    options={
        "base_checkpoint": Opt("base_checkpoint"),
        "out": Opt("out"),
        "count": Opt("count"),
        "visual_ratio": Opt("visual_ratio"),
        **base_options(
            "steps",
            "batch_size",
            "seq_len",
            "lr",
            "seed",
            steps="SFT steps per arm",
            seq_len="Tokens per SFT row",
            lr="Peak SFT learning rate of both arms",
        ),
        "eval_samples": Opt("eval_samples"),
        "eval_max_new_tokens": Opt("eval_max_new_tokens"),
        "rl_iterations": Opt("rl_iterations"),
        **RUN_OPTIONS,
    },
    derived={"base.seq_len": "the longest trajectory's length rounded up to 64"},
)
def ablate_zero_vision(config: zero_vision.ZeroVisionSettings) -> None:
    zero_vision.run_zero_vision(config, console)


REPHRASE_ABLATION_HELP = (
    "K2's rephrasing ablation at small scale: K rephrasings × 1 epoch vs the raw text × K epochs.\n\n"
    "Takes --docs raw documents (of --data or the embedded corpus, each cut to --doc-chars), rephrases each "
    "K times through an OpenAI-compatible endpoint (--base-url; or k2lab's own server started here over "
    "--checkpoint; or reuses --rephrased DIR), and trains the same recipe "
    f"({rephrase.DEFAULT_RECIPE['preset']}, {rephrase.DEFAULT_RECIPE['batch_size']}×"
    f"{rephrase.DEFAULT_RECIPE['seq_len']} tokens per step) on both arms with the same tokenizer, seed and "
    "token budget (K raw epochs). A rephrasing the fidelity check dropped is replaced by the raw text. Compares "
    "the validation loss on raw held-out documents and a cloze QA probe on facts of the training documents.\n\n"
    "Writes OUT/rephrase.md, OUT/rephrase.json and OUT/rephrase.png; rephrasings are cached in OUT/rephrased "
    "and the runs in OUT/runs/ARM are reused when the command is repeated."
)


@ablate_app.command("rephrase", help=REPHRASE_ABLATION_HELP)
@study_command(
    rephrase.RephraseAblationConfig,
    options={
        "data": Opt("data"),
        "out": Opt("out"),
        "base_url": Opt("base_url"),
        "model": Opt("model"),
        "api_key": Opt("api_key", envvar="OPENAI_API_KEY"),
        "checkpoint": Opt("checkpoint"),
        "rephrased": Opt("rephrased"),
        "n_rephrasings": Opt("n_rephrasings"),
        "docs": Opt("docs"),
        "doc_chars": Opt("doc_chars"),
        "heldout_docs": Opt("heldout_docs"),
        "chunk_chars": Opt("chunk_chars"),
        "styles": Opt("styles"),
        "fidelity_threshold": Opt("fidelity_threshold"),
        "concurrency": Opt("concurrency"),
        "max_tokens": Opt("max_tokens"),
        "probe_items": Opt("probe_items"),
        "steps": Opt("steps"),
        **base_options(
            "preset",
            "vocab_size",
            "batch_size",
            "seq_len",
            "lr",
            "seed",
            lr="Peak learning rate of both arms",
            seed="Seed of weights, data order and sampling",
        ),
        **RUN_OPTIONS,
    },
)
def ablate_rephrase(config: rephrase.RephraseAblationConfig) -> None:
    rephrase.run_rephrase_ablation(config, console)


PARL_ABLATION_HELP = (
    "PARL's reward terms on wide tasks (K2.5 Agent Swarm): full reward vs without r_parallel vs without "
    "r_finish vs a single agent without sub-agents.\n\n"
    "Trains the compact orchestrator (a factorised categorical policy over orchestration actions) with "
    "frozen procedural sub-agents for each arm and seed (~1 min on 2 CPU cores by default) and compares "
    "held-out success, CriticalSteps, total tokens (cost) and training iterations to a target success.\n\n"
    "Writes OUT/parl.md, OUT/parl.json and OUT/parl.png; runs live in OUT/runs/ARM/seedS and resume or are "
    "reused when the command is repeated."
)
_PARL_QUICK = parl.QUICK["base"]
PARL_QUICK = Profile(
    parl.QUICK,
    help=f"Smoke run: {_PARL_QUICK['iterations']} iterations, {len(parl.QUICK['seeds'])} seed, "
    f"{_PARL_QUICK['eval_tasks']} tasks.",
)


@ablate_app.command("parl", help=PARL_ABLATION_HELP)
@study_command(
    parl.ParlAblationSettings,
    profiles={"quick": PARL_QUICK},
    options={
        "out": Opt("out"),
        "iterations": Opt("base.iterations", help="Training iterations per run"),
        "seeds": Opt("seeds"),
        "arms": Opt("arms"),
        "target": Opt("target"),
        "eval_tasks": Opt("base.eval_tasks", help="Held-out tasks per evaluation"),
        "solo_prior": Opt("base.solo_prior", help="Initial logit of working alone (single-agent start)"),
        "max_turns": Opt(
            "base.max_turns",
            help="B_main, orchestrator turns per episode (a task of at least B_main shards is serially "
            "impossible; above max shards + 1 every task is serially solvable)",
        ),
        "threads": Opt("threads"),
    },
)
def ablate_parl(config: parl.ParlAblationSettings) -> None:
    parl.run_parl_ablation(config, console)
