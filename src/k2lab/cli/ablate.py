"""The ``ablate`` group: optimizer, balancing, vision-injection, rephrase and PARL studies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k2lab.cli.app import KeepWeightsOption, ThreadsOption, app, console

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
