"""Agentic post-training commands: ``rl``, ``visual-rl``, ``factory generate``, ``recipe agentic-mini``, ``mopd``.

Each command that runs a config (``RLConfig``, ``VisualRLConfig``, ``FactoryConfig``, ``RecipeConfig``,
``MOPDConfig``) takes
``--recipe FILE.toml``, repeatable ``--set key.path=value`` and named options derived from the config
(``k2lab.cli.options``): the defaults and most help texts live on the config's fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import torch
import typer

from k2lab.agentic.distill.effort import (
    DEFAULT_BUDGETS,
    DEFAULT_DOMAINS,
    EFFORTS,
    EXPERT_RL_DEFAULTS,
    ExpertSpec,
    expert_specs,
    train_experts,
)
from k2lab.agentic.distill.mopd import MOPDConfig, markdown_table, mopd_report, run_mopd
from k2lab.agentic.factory.pipeline import FactoryConfig, generate, print_summary, summary_path_for
from k2lab.agentic.recipe import mini as recipe_mini
from k2lab.agentic.recipe.mini import RecipeConfig
from k2lab.agentic.rl.trainer import RLConfig, iteration_report, run_rl
from k2lab.cli.app import app, console
from k2lab.cli.options import Opt, runs_config
from k2lab.errors import K2LabError
from k2lab.fsutil import check_output_file
from k2lab.interrupt import RERUN_TO_CONTINUE, last_checkpoint, reports_interrupt
from k2lab.vision.rl import SUMMARY, VisualRLConfig, evaluation_report, run_visual_rl
from k2lab.vision.rl import iteration_report as visual_iteration_report

CpuThreads = Annotated[int | None, typer.Option(min=1, help="torch CPU threads.")]
ResumeRun = Annotated[
    bool, typer.Option("--resume/--no-resume", help="Continue from OUT/checkpoints when present.")
]


def _rerun_hint(resume: bool) -> str:
    """How an interrupted ``rl`` / ``visual-rl`` goes on: rerun it, resuming (the default) when it did not."""
    return RERUN_TO_CONTINUE if resume else "run the same command without --no-resume to continue"


def _options(*names: str) -> dict[str, Opt]:
    """``Opt(name)`` for config fields whose name, description and default are the option's."""
    return {name: Opt(name) for name in names}


# spellings of the config's names that the commands took before (kept as aliases)
GROUP_SIZE = Opt("group_size", "--group-size", "--group")
GROUPS_PER_ITERATION = Opt("groups_per_iteration", "--groups-per-iteration", "--prompts")
UPDATES_PER_ITERATION = Opt("updates_per_iteration", "--updates-per-iteration", "--updates")
TEMPERATURE_START = Opt("temperature_start", "--temperature-start", "--temperature")
MUONCLIP_LR = Opt("optimizer.lr", help="MuonClip learning rate.")

RL_OPTIONS = {
    **_options("iterations"),
    "group_size": GROUP_SIZE,
    "groups_per_iteration": GROUPS_PER_ITERATION,
    **_options("envs", "env_weights", "max_new_tokens", "token_limit"),
    "temperature_start": TEMPERATURE_START,
    **_options("temperature_floor", "temperature_decay", "tau", "offpolicy_clip", "budget_penalty"),
    "updates_per_iteration": UPDATES_PER_ITERATION,
    **_options("ptx_data", "ptx_weight", "critic"),
    "lr": MUONCLIP_LR,
    **_options("checkpoint_every", "seed"),
}


@app.command()
@runs_config(RLConfig, options=RL_OPTIONS)
def rl(
    config: RLConfig,
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", "-c", help="k2lab model directory with tokenizer.json.")
    ],
    out: Annotated[Path, typer.Option(help="Run directory (metrics, checkpoints, final model).")],
    threads: CpuThreads = None,
    resume: ResumeRun = True,
) -> None:
    """Joint RL (K2): verifiable environments + rubric critic, K1.5's objective, MuonClip, exact resume."""
    try:
        with reports_interrupt(out, last_checkpoint(out, "iteration"), _rerun_hint(resume)):
            history = run_rl(
                checkpoint, out, config, resume=resume, threads=threads,
                on_iteration=lambda m: console.print(iteration_report(m, config.iterations), markup=False),
            )  # fmt: skip
    except ValueError as error:
        raise K2LabError(str(error)) from error
    last = history[-1] if history else {}
    console.print(
        f"RL done: {len(history)} iterations this run, last mean reward {last.get('mean_reward')}, "
        f"metrics in {out / 'metrics.jsonl'}, policy in {out / 'model'}"
    )


VISUAL_RL_OPTIONS = {
    **_options("iterations"),
    "prompts_per_iteration": Opt("prompts_per_iteration", "--prompts-per-iteration", "--prompts"),
    "group_size": GROUP_SIZE,
    **_options("tasks", "max_new_tokens"),
    "temperature_start": TEMPERATURE_START,
    **_options("temperature_floor", "temperature_decay", "tau", "offpolicy_clip"),
    "updates_per_iteration": UPDATES_PER_ITERATION,
    **_options("freeze_vision"),
    "lr": MUONCLIP_LR,
    **_options("eval_samples", "text_eval_rows", "text_eval_seq_len", "text_eval_data"),
    **_options("checkpoint_every", "keep_checkpoints", "seed"),
}


@app.command("visual-rl")
@runs_config(VisualRLConfig, options=VISUAL_RL_OPTIONS)
def visual_rl(
    config: VisualRLConfig,
    checkpoint: Annotated[
        Path,
        typer.Option("--checkpoint", "-c", help="Vision-language model directory with tokenizer.json."),
    ],
    out: Annotated[Path, typer.Option(help="Run directory (metrics, checkpoints, summary, final model).")],
    threads: CpuThreads = None,
    resume: ResumeRun = True,
) -> None:
    """K2.5's visual RL: synthetic visual tasks asked in chat, K answers per image, visual rewards, K1.5's
    objective, MuonClip on the language model and the tower, held-out chat evaluation before and after."""
    try:
        with reports_interrupt(out, last_checkpoint(out, "iteration"), _rerun_hint(resume)):
            history = run_visual_rl(
                checkpoint, out, config, resume=resume, threads=threads,
                on_iteration=lambda m: console.print(
                    visual_iteration_report(m, config.iterations), markup=False
                ),
            )  # fmt: skip
    except ValueError as error:
        raise K2LabError(str(error)) from error
    last = history[-1] if history else {}
    console.print(
        f"visual RL done: {len(history)} iterations this run, last mean reward {last.get('mean_reward')}, "
        f"held-out before/after in {out / 'summary.json'}, model in {out / 'model'}",
        markup=False,
    )
    summary = json.loads((out / SUMMARY).read_text()) if (out / SUMMARY).is_file() else {}
    if report := evaluation_report(summary):
        console.print(f"before → after visual RL: {report}", markup=False)


factory_app = typer.Typer(
    help="K2's agentic data factory: tool tasks rolled out by expert agents, judged by rubrics.",
    no_args_is_help=True,
)


app.add_typer(factory_app, name="factory")


@factory_app.command("generate")
@runs_config(
    FactoryConfig,
    options={
        **_options("n", "seed"),
        "tools": Opt("tools_path", "--tools"),
        **_options("failure_rate", "imperfection", "no_tool_fraction", "mcp_fraction"),
        **_options("variants_per_tool", "max_distractors"),
    },
)
def factory_generate(
    config: FactoryConfig,
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="Kept trajectories (JSONL); summary: OUT's stem + .summary.json."),
    ] = Path("trajectories.jsonl"),
) -> None:
    """Roll out N tool tasks with expert agents, judge them by rubric, write the kept conversations (JSONL).

    Runs on CPU without an external model: synthetic tools evolved over a domain hierarchy (plus harvested
    MCP tools with --tools), a stateful simulator injecting failures, scripted users and procedural experts
    (imperfect on a share of tasks, so the judge has trajectories to reject).
    """
    if config.tools_path is not None and not config.tools_path.is_file():
        raise K2LabError(f"--tools {config.tools_path}: no such file")
    for target, what in ((out, "the trajectories"), (summary_path_for(out), "the factory summary")):
        check_output_file(target, what, [config.tools_path])
    kept = "no new trajectories (they are written once all tasks are rolled out)"
    with reports_interrupt(out, lambda: kept, "run the same command again to generate them"):
        result = generate(config)
    summary = result.write(out)
    print_summary(result.summary, console)
    console.print(
        f"wrote {len(result.kept)} trajectories to {out} (summary: {summary})",
        highlight=False,
        soft_wrap=True,
    )


recipe_app = typer.Typer(help="End-to-end recipes that chain k2lab's stages.", no_args_is_help=True)


app.add_typer(recipe_app, name="recipe")


@recipe_app.command("agentic-mini")
@runs_config(
    RecipeConfig,
    options={
        "out": Opt("out", "-o"),
        **_options("base", "pretrain_steps", "factory_n", "sft_steps", "rl_iterations", "rl_groups"),
        **_options("rl_group_size", "credit", "partial_credit", "rl_no_tool_fraction", "eval_n"),
        **_options("no_tool_eval_n", "eval_seed", "eval_batch_size", "threads"),
    },
)
def recipe_agentic_mini(config: RecipeConfig) -> None:
    """Pre-trained mini model -> factory data -> SFT -> RL -> held-out evaluation (CPU, ~25 min).

    Every stage is reused when complete, so a killed run resumes; a rerun into OUT with a setting a finished
    or started stage depends on changed is refused (OUT/stages.json). Writes report.json, report.md and
    agentic_mini.png in OUT.
    """
    try:  # looked up on the module at run time, so a test can replace them
        report = recipe_mini.run_recipe(
            config, log=lambda text: console.print(text, highlight=False, markup=False)
        )
    except ValueError as error:
        raise K2LabError(str(error)) from error
    recipe_mini.print_report(report, console)
    out = config.out
    console.print(f"reports: {out / 'report.md'}, {out / 'report.json'}, {out / 'agentic_mini.png'}")


mopd_app = typer.Typer(
    help="K3's multi-effort RL (3 domains x 3 effort levels = 9 experts) merged by multi-teacher "
    "on-policy distillation.",
    no_args_is_help=True,
)


app.add_typer(mopd_app, name="mopd")


def _mopd_budgets(text: str) -> dict[str, int]:
    """``--budgets low,high,max`` as effort -> token budget (checked further by ``expert_specs``)."""
    wanted = f"--budgets needs {len(EFFORTS)} comma-separated whole token budgets ({','.join(EFFORTS)})"
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as error:
        raise K2LabError(f"{wanted}, not {text!r}") from error
    if len(values) != len(EFFORTS):
        raise K2LabError(f"{wanted}, not {text!r}")
    return dict(zip(EFFORTS, values, strict=True))


def _mopd_specs(domains: str, budgets: str) -> list[ExpertSpec]:
    """The experts of ``--domains`` and ``--budgets``, checked before any of them trains."""
    try:
        return expert_specs([d.strip() for d in domains.split(",") if d.strip()], _mopd_budgets(budgets))
    except ValueError as error:
        raise K2LabError(str(error)) from error


@mopd_app.command("experts")
@runs_config(
    RLConfig,
    defaults=EXPERT_RL_DEFAULTS,
    options={
        "iterations": Opt("iterations", help="RL iterations per expert."),
        "group_size": GROUP_SIZE,
        "groups_per_iteration": GROUPS_PER_ITERATION,
        "updates_per_iteration": UPDATES_PER_ITERATION,
        "budget_penalty": Opt("budget_penalty"),
        "lr": MUONCLIP_LR,
        "temperature_start": TEMPERATURE_START,
        "seed": Opt("seed", help="Seed of the first expert (expert i uses seed + i)."),
        "checkpoint_every": Opt("checkpoint_every"),
        "keep_checkpoints": Opt("keep_checkpoints", help="Checkpoints kept per expert."),
    },
)
def mopd_experts(
    config: RLConfig,
    checkpoint: Annotated[
        Path, typer.Option("--checkpoint", "-c", help="SFT model directory with tokenizer.json.")
    ],
    out: Annotated[Path, typer.Option(help="Experts directory (one RL run per domain-effort).")],
    domains: Annotated[str, typer.Option(help="Comma-separated environments.")] = ",".join(DEFAULT_DOMAINS),
    budgets: Annotated[
        str, typer.Option(help="Token budgets of low,high,max effort (increasing).")
    ] = ",".join(str(DEFAULT_BUDGETS[effort]) for effort in EFFORTS),
    threads: CpuThreads = None,
) -> None:
    """Train the nine effort experts by RL from one SFT checkpoint (skips finished ones, resumes the rest)."""
    if threads is not None:
        torch.set_num_threads(threads)
    specs = _mopd_specs(domains, budgets)
    train_experts(checkpoint, out, config, specs, log=lambda text: console.print(text, highlight=False))
    console.print(f"experts: {out / 'experts.json'}")


@mopd_app.command("distill")
@runs_config(
    MOPDConfig,
    options={
        **_options("steps"),
        "prompts_per_step": Opt("prompts_per_step", "--prompts-per-step", "--prompts"),
        **_options("temperature", "objective"),
        "lr": MUONCLIP_LR,
        **_options("checkpoint_every", "keep_checkpoints", "seed"),
    },
)
def mopd_distill(
    config: MOPDConfig,
    experts: Annotated[Path, typer.Option(help="Experts directory from `k2lab mopd experts`.")],
    student: Annotated[Path, typer.Option(help="Student's starting model (the SFT checkpoint).")],
    out: Annotated[Path, typer.Option(help="Run directory (metrics, checkpoints, OUT/model).")],
    threads: CpuThreads = None,
) -> None:
    """Multi-teacher on-policy distillation: per-token reward log π_teacher − log π_student (exact resume)."""
    if threads is not None:
        torch.set_num_threads(threads)

    def show(m: dict) -> None:
        console.print(
            f"step {m['step']}: loss {m['loss']} reverse KL {m['reverse_kl']} reward {m['mean_reward']} "
            f"tokens {m['trained_tokens']} ({m['seconds']} s)",
            highlight=False,
        )

    with reports_interrupt(out, last_checkpoint(out, "step"), RERUN_TO_CONTINUE):  # it resumes when rerun
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
    threads: CpuThreads = None,
) -> None:
    """Per cell: MOPD student vs its teacher (goal ≥ 90 %) and vs an SFT-on-teacher-samples baseline."""
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
