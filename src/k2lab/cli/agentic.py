"""Agentic post-training commands: ``rl``, ``factory generate``, ``recipe agentic-mini``, ``mopd``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k2lab.cli.app import app, console
from k2lab.errors import K2LabError


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
    from k2lab.agentic.rl.trainer import RLConfig, run_rl
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
    from k2lab.agentic.factory.pipeline import FactoryConfig, generate, print_summary

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
    from k2lab.agentic.recipe.mini import RecipeConfig, print_report, run_recipe

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
    from k2lab.agentic.distill.effort import EFFORTS

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

    from k2lab.agentic.distill.effort import expert_specs, train_experts
    from k2lab.agentic.rl.trainer import RLConfig
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

    from k2lab.agentic.distill.mopd import MOPDConfig, run_mopd
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

    from k2lab.agentic.distill.mopd import markdown_table, mopd_report

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
