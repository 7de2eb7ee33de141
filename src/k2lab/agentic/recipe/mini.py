"""``k2lab recipe agentic-mini``: pre-trained mini model -> factory data -> SFT -> RL -> evaluation, on CPU.

Stages, each in its own subdirectory of ``out`` and skipped when its ``done.json`` exists (so a killed run
resumes; SFT and RL also resume from their own checkpoints mid-stage):

* ``base``: the ``--base`` model directory, or k2-mini pre-trained with the demo recipe (fewer steps);
* ``factory``: ``factory_n`` trajectories from the agentic data factory (seed ``factory_seed``);
* ``sft``: the base fine-tuned on the kept trajectories (``TrainConfig.sft``);
* ``rl``: ``run_rl`` from the SFT model on the factory's tool tasks, no-tool tasks over-sampled and given a
  token budget so the budget penalty applies; a failed task earns ``partial_credit`` x its solution
  progress (``credit="progress"``: planned calls graded by their arguments, the answer's key facts) rather
  than x the fraction of rubric checks met (``"checks"``), which pays an answer that does nothing;
* ``eval``: base, SFT and RL on ``eval_n`` held-out tasks (seeds ``eval_seed * 1_000_003 + i``, a factory
  seed no training stage uses; RL draws hashed task seeds), batched greedy decoding
  (``k2lab.agentic.episodes.evaluate``), and on a probe of ``no_tool_eval_n`` held-out tasks that need no tool
  (seeds ``eval_seed * 1_000_003 + NO_TOOL_OFFSET + i``): the main set holds only ~15 % of those, too few
  to see whether RL's budget penalty lowers the tool calls made where none is needed.

Each stage records the settings it depends on (``STAGE_SETTINGS``, its own and those of the stages it
builds on) in ``out/stages.json`` when it starts; a rerun into the same ``out`` with any of them changed is
refused before the stage runs, instead of reusing results made with other settings. A stage killed after its
training wrote its results but before ``done.json`` is finished from those results.

Outputs in ``out``: ``report.json``, ``report.md``, ``agentic_mini.png`` and per-stage wall times.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from rich.table import Table

from k2lab.agentic.episodes.env import Episode
from k2lab.agentic.episodes.evaluate import evaluate_policy, paired_comparison, wilson_interval
from k2lab.agentic.factory.pipeline import FactoryConfig, generate
from k2lab.agentic.factory.tasks import MINI_TOOLS, ToolTaskEnvironment, check_credit
from k2lab.agentic.factory.tools import build_repository
from k2lab.agentic.rl.trainer import RLConfig, run_rl
from k2lab.data import load_tokenizer
from k2lab.fsutil import atomic_write_text, make_directory, save_figure_atomically
from k2lab.interrupt import RERUN_TO_CONTINUE
from k2lab.model_dir import load_text_model
from k2lab.optim.grouping import OptimizerConfig
from k2lab.posttrain.base import METRICS, metrics_history
from k2lab.train.config import load_sft_config, load_train_config
from k2lab.train.persistence import check_resumed_config
from k2lab.train.resume import SUMMARY_FILE, results_written
from k2lab.train.trainer import run_training

__all__ = ["RecipeConfig", "RecipeToolTasks", "eval_seeds", "print_report", "run_recipe"]

STAGES = ("base", "factory", "sft", "rl", "eval")
NO_TOOL_OFFSET = 500_000
EVALUATED = ("base", "sft", "rl")


class RecipeConfig(BaseModel):
    """Sizes of every stage (defaults: about 25 minutes on 2 CPU cores with an existing base)."""

    model_config = ConfigDict(extra="forbid")

    out: Path = Field(
        default=Path("runs/agentic-mini"), description="Run directory (one subdirectory per stage)."
    )
    base: Path | None = Field(
        default=None, description="Trained k2lab model dir (tokenizer.json); unset: pre-train one."
    )
    pretrain_recipe: Path = Path("recipes/k2-mini-demo.toml")
    pretrain_steps: int = Field(default=250, ge=1, description="Pre-training steps without a base.")
    factory_n: int = Field(default=1500, ge=1, description="Factory tasks rolled out for SFT data.")
    factory_seed: int = 0
    variants_per_tool: int = MINI_TOOLS["variants_per_tool"]
    max_distractors: int = MINI_TOOLS["max_distractors"]
    partial_credit: float = Field(
        default=MINI_TOOLS["partial_credit"],
        ge=0.0,
        le=1.0,
        description="RL reward of a failed task = this x its credit (0: reward for success only).",
    )
    credit: str = Field(
        default="progress",
        description="RL partial credit of a failed task: progress (planned calls graded by their arguments, "
        "the answer's key facts) or checks (fraction of rubric checks met).",
    )
    sft_steps: int = Field(default=240, ge=1, description="SFT optimizer steps.")
    sft_batch_size: int = 4
    sft_seq_len: int = 1024
    sft_lr: float = 1e-3
    rl_iterations: int = Field(default=12, ge=1, description="RL iterations.")
    rl_groups: int = Field(default=4, ge=1, description="RL prompts per iteration.")
    rl_group_size: int = Field(default=4, ge=2, description="RL samples per prompt (K).")
    rl_lr: float = 2e-4
    rl_updates: int = 1
    rl_no_tool_fraction: float = Field(
        default=0.6, ge=0.0, le=1.0, description="Share of RL prompts that need no tool."
    )
    budget_penalty: float = 0.5
    no_tool_budget: int = 24
    max_new_tokens: int = 128
    max_turns: int = MINI_TOOLS["max_turns"]
    eval_n: int = Field(default=200, ge=1, description="Held-out evaluation tasks.")
    no_tool_eval_n: int = Field(
        default=300, ge=0, description="Held-out tasks that need no tool, for the tool-call probe."
    )
    eval_seed: int = Field(default=7, description="Factory seed of the held-out tasks, unused in training.")
    eval_batch_size: int = Field(default=32, ge=1, description="Rows per batched generate call.")
    threads: int | None = Field(default=None, ge=1, description="torch CPU threads.")
    seed: int = 0
    pretrain_overrides: dict[str, Any] = Field(default_factory=dict)


class RecipeToolTasks(ToolTaskEnvironment):
    """The factory's tool tasks over the recipe's repository (``variants_per_tool`` evolved variants of each
    base tool, ``max_distractors`` foreign tools per agent), with at most ``max_turns`` assistant turns and a
    token budget on the tasks that need no tool (the budget penalty of RL applies to them)."""

    def __init__(
        self,
        config: RecipeConfig,
        no_tool_fraction: float = 0.15,
        partial_credit: float = 0.0,
    ) -> None:
        super().__init__(
            build_repository(config.factory_seed, config.variants_per_tool),
            no_tool_fraction=no_tool_fraction,
            max_distractors=config.max_distractors,
            partial_credit=partial_credit,
            max_turns=config.max_turns,
            credit=config.credit,
        )
        self.no_tool_budget = config.no_tool_budget

    def reset(self, seed: int) -> Episode:
        episode = super().reset(seed)
        if not episode.needs_tools:
            episode.token_budget = self.no_tool_budget
        return episode


def _held_out_start(config: RecipeConfig) -> int:
    """The first held-out seed: the factory's numbering for a seed no training stage uses."""
    if config.eval_seed == config.factory_seed:
        raise ValueError("eval_seed must differ from factory_seed (held-out tasks)")
    return config.eval_seed * 1_000_003


def eval_seeds(config: RecipeConfig) -> list[int]:
    """The held-out task seeds."""
    start = _held_out_start(config)
    return [start + i for i in range(config.eval_n)]


def no_tool_eval_seeds(config: RecipeConfig) -> list[int]:
    """The held-out seeds of the no-tool probe (after the main set's, in the same numbering)."""
    if config.eval_n > NO_TOOL_OFFSET:
        raise ValueError(f"eval_n must be at most {NO_TOOL_OFFSET} (the probe's seeds follow the main set's)")
    start = _held_out_start(config) + NO_TOOL_OFFSET
    return [start + i for i in range(config.no_tool_eval_n)]


# ------------------------------------------------------------------------------------------ stages


_BASE = ("base", "pretrain_recipe", "pretrain_steps", "pretrain_overrides")
_FACTORY = ("factory_n", "factory_seed", "variants_per_tool", "max_distractors")
_SFT = (*_BASE, *_FACTORY, "sft_steps", "sft_batch_size", "sft_seq_len", "sft_lr", "seed")
_RL = (
    *_SFT,
    *("rl_iterations", "rl_groups", "rl_group_size", "rl_lr", "rl_updates", "rl_no_tool_fraction"),
    *("budget_penalty", "no_tool_budget", "max_new_tokens", "max_turns", "partial_credit", "credit"),
)
STAGE_SETTINGS: dict[str, tuple[str, ...]] = {
    "base": _BASE,
    "factory": _FACTORY,
    "sft": _SFT,
    "rl": _RL,
    "eval": (*_RL, "eval_n", "no_tool_eval_n", "eval_seed", "eval_batch_size"),
}
SETTINGS_FILE = "stages.json"


def stage_settings(config: RecipeConfig, name: str) -> dict[str, Any]:
    """The recipe settings stage ``name``'s results depend on (JSON values; paths resolved, so another
    spelling of the same base model or pre-training recipe is the same setting). With a ``base`` given,
    the pre-training settings are unused and left out."""
    dumped = config.model_dump(mode="json") | {
        key: str(path.resolve()) for key in ("base", "pretrain_recipe") if (path := getattr(config, key))
    }
    unused = _BASE[1:] if config.base is not None else ()
    return {key: dumped[key] for key in STAGE_SETTINGS[name] if key not in unused}


def _claim_stage(out: Path, name: str, settings: dict[str, Any]) -> None:
    """Record stage ``name``'s ``settings`` in ``out/stages.json``, or refuse when it holds other ones."""
    path = out / SETTINGS_FILE
    claimed = json.loads(path.read_text()) if path.is_file() else {}
    if name in claimed:
        check_resumed_config(claimed[name], settings, out / name)
    else:
        atomic_write_text(path, json.dumps(claimed | {name: settings}, indent=2) + "\n")


def _stage(
    out: Path,
    name: str,
    settings: dict[str, Any],
    work: Callable[[Path], dict[str, Any]],
    log: Callable[[str], None],
) -> dict:
    """Run ``work(dir)`` unless ``dir/done.json`` exists; the stage's record (with its wall time). Refused
    when the stage was started with other ``settings``."""
    directory = out / name
    done = directory / "done.json"
    _claim_stage(out, name, settings)
    if done.is_file():
        record = json.loads(done.read_text())
        log(f"[{name}] complete, reused ({record['seconds']:.0f} s when it ran)")
        return record | {"reused": True}
    directory.mkdir(parents=True, exist_ok=True)
    log(f"[{name}] running")
    started = time.perf_counter()
    record = work(directory)
    record["seconds"] = round(time.perf_counter() - started, 2)
    atomic_write_text(done, json.dumps(record, indent=2) + "\n")
    log(f"[{name}] done in {record['seconds']:.0f} s")
    return record | {"reused": False}


def stage_base(config: RecipeConfig, directory: Path) -> dict[str, Any]:
    """The base model: ``--base`` as given, or a short pre-training run of the demo recipe."""
    if config.base is not None:
        if not (config.base / "tokenizer.json").is_file():
            raise ValueError(f"--base {config.base} is not a k2lab model directory with tokenizer.json")
        return {"model": str(config.base), "pretrained_here": False}
    overrides = {"steps": config.pretrain_steps, "out": str(directory), "save_every": 50, "keep_last": 1}
    train = load_train_config(config.pretrain_recipe, **(overrides | config.pretrain_overrides))
    summary = _train(train, directory)
    return {
        "model": str(directory / "model"),
        "pretrained_here": True,
        "steps": train.steps,
        **_floats(summary),
    }


def stage_factory(config: RecipeConfig, directory: Path) -> dict[str, Any]:
    """Factory trajectories (seed ``factory_seed``)."""
    result = generate(
        FactoryConfig(
            n=config.factory_n,
            seed=config.factory_seed,
            variants_per_tool=config.variants_per_tool,
            max_distractors=config.max_distractors,
        )
    )
    path = directory / "trajectories.jsonl"
    result.write(path)
    return {"data": str(path), "episodes": config.factory_n, "kept": len(result.kept)}


def stage_sft(config: RecipeConfig, directory: Path, base: str, data: str) -> dict[str, Any]:
    """SFT of the base on the trajectories (resumes from its checkpoints)."""
    every = max(1, config.sft_steps // 4)
    train = load_sft_config(
        None,
        out=str(directory),
        steps=config.sft_steps,
        batch_size=config.sft_batch_size,
        seq_len=config.sft_seq_len,
        eval_every=max(1, config.sft_steps // 2),
        eval_batches=2,
        save_every=every,
        keep_last=1,
        sample_tokens=0,
        seed=config.seed,
        **{"sft.init_checkpoint": base, "sft.data": data, "optimizer.lr": config.sft_lr},
    )
    summary = _train(train, directory)
    return {"model": str(directory / "model"), "steps": train.steps, **_floats(summary)}


def _train(train: Any, directory: Path) -> dict[str, Any]:
    """``run_training`` resumed, or the summary of a run that already finished there (killed before the
    stage's ``done.json``: its settings were checked by the stage)."""
    if results_written(directory):
        return json.loads((directory / SUMMARY_FILE).read_text())
    return run_training(train, resume=True, resume_hint=RERUN_TO_CONTINUE)


def rl_config(config: RecipeConfig) -> Any:
    """The ``RLConfig`` of the RL stage."""
    return RLConfig(
        iterations=config.rl_iterations,
        groups_per_iteration=config.rl_groups,
        group_size=config.rl_group_size,
        envs=["tools"],
        max_new_tokens=config.max_new_tokens,
        temperature_start=0.8,
        temperature_floor=0.5,
        temperature_decay=0.9,
        budget_penalty=config.budget_penalty,
        updates_per_iteration=config.rl_updates,
        optimizer=OptimizerConfig(lr=config.rl_lr),
        checkpoint_every=1,
        keep_checkpoints=1,
        seed=config.seed + 1,
    )


def stage_rl(config: RecipeConfig, directory: Path, sft_model: str) -> dict[str, Any]:
    """RL from the SFT model on tool tasks + budgeted no-tool tasks (resumes from its checkpoints)."""
    env = RecipeToolTasks(config, config.rl_no_tool_fraction, config.partial_credit)
    history = run_rl(sft_model, directory, rl_config(config), resume=True, threads=config.threads, env=env)
    history = history or metrics_history(directory / METRICS)  # empty: it had finished before a kill
    last = history[-1] if history else {}
    return {
        "model": str(directory / "model"),
        "iterations": config.rl_iterations,
        "metrics": str(directory / "metrics.jsonl"),
        "last_mean_reward": last.get("mean_reward"),
    }


def stage_eval(config: RecipeConfig, directory: Path, models: dict[str, str], log: Callable) -> dict:
    """Every model on the held-out tasks (one file per model, reused when present)."""
    reports = {}
    for name, path in models.items():
        target = directory / f"{name}.json"
        if not target.is_file():
            report = evaluate_model(config, path)
            atomic_write_text(target, json.dumps(report, indent=2) + "\n")
            log(f"[eval] {name}: success {report['success']:.3f} in {report['seconds']:.0f} s")
        reports[name] = str(target)
    return {"reports": reports, "seeds": [eval_seeds(config)[0], eval_seeds(config)[-1]]}


def evaluate_model(config: RecipeConfig, path: str) -> dict[str, Any]:
    """One model directory on the held-out tasks, with the no-tool probe's result under ``no_tool_probe``."""
    model = load_text_model(path, "the recipe's evaluation").eval()
    tokenizer = load_tokenizer(Path(path) / "tokenizer.json")

    def run(env: RecipeToolTasks, seeds: list[int]) -> dict[str, Any]:
        return evaluate_policy(model, tokenizer, env, seeds, config.eval_batch_size, config.max_new_tokens)

    report = run(RecipeToolTasks(config), eval_seeds(config))
    probe = run(RecipeToolTasks(config, no_tool_fraction=1.0), no_tool_eval_seeds(config))
    report["no_tool_probe"] = no_tool_summary(probe)
    report["seconds"] = round(report["seconds"] + probe["seconds"], 3)
    return report


def no_tool_summary(probe: dict[str, Any]) -> dict[str, Any]:
    """Tool calls per task, the share of tasks with any tool call (with its Wilson interval), success on the
    no-tool probe, and per task whether it stayed without a tool call (``quiet``: rows for
    ``paired_comparison``)."""
    episodes = probe["episodes"]
    calling = sum(e["tool_calls"] > 0 for e in episodes)
    return {
        "tasks": len(episodes),
        "tool_calls": probe["tool_calls_per_task"],
        "calling": calling,
        "calling_share": calling / len(episodes) if episodes else None,
        "calling_ci95": list(wilson_interval(calling, len(episodes))),
        "success": probe["success"],
        "quiet": [{"seed": e["seed"], "success": e["tool_calls"] == 0} for e in episodes],
    }


def _floats(summary: dict[str, Any] | None) -> dict[str, float]:
    return {k: float(v) for k, v in (summary or {}).items() if isinstance(v, int | float)}


# ------------------------------------------------------------------------------------------ the run


def run_recipe(config: RecipeConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) every stage and write the reports; returns ``report.json``'s content."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    eval_seeds(config)
    check_credit(config.credit)  # before any stage: the RL stage's environment would refuse it late
    out = make_directory(Path(config.out), "the recipe's output directory")
    records: dict[str, dict[str, Any]] = {}
    works: dict[str, Callable[[Path], dict[str, Any]]] = {
        "base": lambda d: stage_base(config, d),
        "factory": lambda d: stage_factory(config, d),
        "sft": lambda d: stage_sft(config, d, records["base"]["model"], records["factory"]["data"]),
        "rl": lambda d: stage_rl(config, d, records["sft"]["model"]),
        "eval": lambda d: stage_eval(config, d, {name: records[name]["model"] for name in EVALUATED}, log),
    }
    for name, work in works.items():
        records[name] = _stage(out, name, stage_settings(config, name), work, log)
    return write_reports(config, out, records)


def write_reports(config: RecipeConfig, out: Path, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """report.json, report.md and agentic_mini.png from the stage records."""
    evaluations, episodes, quiet = {}, {}, {}
    for name, path in records["eval"]["reports"].items():
        report = json.loads(Path(path).read_text())
        episodes[name] = report.pop("episodes")
        quiet[name] = report["no_tool_probe"].pop("quiet", None)
        evaluations[name] = report
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.model_dump().items()},
        "stages": {name: records[name] for name in STAGES},
        "seconds": {name: records[name]["seconds"] for name in STAGES},
        "total_seconds": round(sum(records[name]["seconds"] for name in STAGES), 2),
        "evaluation": evaluations,
    }
    report["paired"] = {
        "sft_vs_base": paired_comparison(episodes["base"], episodes["sft"]),
        "rl_vs_sft": paired_comparison(episodes["sft"], episodes["rl"]),
    }
    if quiet["sft"] is not None and quiet["rl"] is not None:  # evaluations written before it lack the rows
        report["paired"]["rl_vs_sft_no_tool_call"] = paired_comparison(quiet["sft"], quiet["rl"])
    report["acceptance"] = acceptance(evaluations, report["paired"])
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out / "report.md", markdown(report))
    plot(evaluations, Path(records["rl"]["metrics"]), out / "agentic_mini.png")
    return report


ALPHA = 0.05


def acceptance(evaluations: dict[str, dict[str, Any]], paired: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """The goals: SFT above base and RL above SFT on the same held-out tasks (the later stage solves more of
    the tasks only one of the two solves, and McNemar's exact p < ``ALPHA``: a higher point estimate alone
    is not "above"), and, on the no-tool probe, RL making no tool call on more of the tasks where only one
    of RL and SFT calls, at p < ``ALPHA`` (``rl_vs_sft_no_tool_call``; without those pairs, from reports
    written before them, fewer tool calls per task)."""
    if "rl_vs_sft_no_tool_call" in paired:
        fewer_calls = _better(paired["rl_vs_sft_no_tool_call"])
    else:
        sft, rl = evaluations["sft"], evaluations["rl"]
        fewer_calls = (rl["no_tool_probe"]["tool_calls"] or 0) < (sft["no_tool_probe"]["tool_calls"] or 0)
    return {
        "sft_above_base": _better(paired["sft_vs_base"]),
        "rl_above_sft": _better(paired["rl_vs_sft"]),
        "rl_fewer_no_tool_calls_than_sft": fewer_calls,
    }


def _better(pair: dict[str, Any]) -> bool:
    return pair["only_after"] > pair["only_before"] and pair["p_value"] < ALPHA


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """Stage, success ± CI, tool calls on no-tool tasks, tokens/task, wall time."""
    rows = []
    for name, result in report["evaluation"].items():
        low, high = result["ci95"]
        rows.append(
            [
                name,
                f"{result['success']:.3f} [{low:.3f}, {high:.3f}] ({result['successes']}/{result['tasks']})",
                _no_tool_cell(result["no_tool_probe"]),
                _fmt(result["tokens_per_task"], 1),
                f"{report['seconds'][name]:.0f}",
            ]
        )
    return rows


HEADER = [
    "stage",
    "success [95% Wilson CI]",
    "tool calls per no-tool task (probe)",
    "tokens/task",
    "stage wall s",
]


def markdown(report: dict[str, Any]) -> str:
    """report.md: the table, per-domain success, stage times and the acceptance checks."""
    lines = ["# agentic-mini", "", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(report)]
    domains = sorted({d for r in report["evaluation"].values() for d in r["domains"]})
    lines += ["", "## success per domain", "", "| domain | " + " | ".join(report["evaluation"]) + " |"]
    lines.append("|" + "---|" * (1 + len(report["evaluation"])))
    for domain in domains:
        cells = [_domain_cell(r["domains"].get(domain)) for r in report["evaluation"].values()]
        lines.append(f"| {domain} | " + " | ".join(cells) + " |")
    lines += ["", "## paired comparison on the same tasks (McNemar, exact)", ""]
    lines += [
        "| comparison | solved only by the later | solved only by the earlier | p |",
        "|---|---|---|---|",
    ]
    for name, pair in report["paired"].items():
        lines.append(f"| {name} | {pair['only_after']} | {pair['only_before']} | {pair['p_value']:.3g} |")
    if "rl_vs_sft_no_tool_call" in report["paired"]:
        lines += ["", "rl_vs_sft_no_tool_call: no-tool probe tasks, solved = made no tool call."]
    lines += ["", "## wall time per stage (s)", ""]
    lines += [f"- {name}: {seconds:.0f}" for name, seconds in report["seconds"].items()]
    lines += [f"- total: {report['total_seconds']:.0f}", "", f"## acceptance (paired p < {ALPHA})", ""]
    lines += [f"- {name}: {'yes' if ok else 'no'}" for name, ok in report["acceptance"].items()]
    return "\n".join(lines) + "\n"


def _no_tool_cell(probe: dict[str, Any]) -> str:
    share = probe["calling_share"]
    calling = "–" if share is None else f"{probe['calling']}/{probe['tasks']} call"
    return f"{_fmt(probe['tool_calls'])} ({calling})"


def _domain_cell(row: dict[str, Any] | None) -> str:
    return "–" if row is None else f"{row['success']:.2f} (n={row['tasks']})"


def print_report(report: dict[str, Any], console: Any) -> None:
    """The table as rich output."""
    table = Table(title="agentic-mini: held-out tool tasks")
    for column in HEADER:
        table.add_column(column)
    for row in table_rows(report):
        table.add_row(*row)
    console.print(table)
    times = ", ".join(f"{k} {v:.0f} s" for k, v in report["seconds"].items())
    console.print(f"wall time: {times}; total {report['total_seconds']:.0f} s", highlight=False)


def plot(evaluations: dict[str, dict[str, Any]], metrics: Path, png: Path) -> Path:
    """Success with CIs per stage, and the RL curves (reward, success, tool calls, tokens per task)."""
    import matplotlib  # lazy: matplotlib (0.3 s) only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only to draw

    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    figure, axes = plt.subplots(1, 5, figsize=(20, 3.8))
    names = list(evaluations)
    values = [evaluations[n]["success"] for n in names]
    errors = [  # clamped: at p = 0 or 1 the interval's end equals p up to rounding
        [max(0.0, v - evaluations[n]["ci95"][0]) for n, v in zip(names, values, strict=True)],
        [max(0.0, evaluations[n]["ci95"][1] - v) for n, v in zip(names, values, strict=True)],
    ]
    axes[0].bar(names, values, yerr=errors, capsize=6, color=["#999", "#4c72b0", "#dd8452"][: len(names)])
    axes[0].set_title("held-out success (95% Wilson CI)")
    axes[0].set_ylim(0, 1)
    panels = (
        ("mean_reward", "RL mean reward"),
        ("success", "RL success"),
        ("tool_calls_per_task", "RL tool calls / task"),
        ("tokens_per_task", "RL tokens / task"),
    )
    for axis, (key, title) in zip(axes[1:], panels, strict=True):
        points = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o")
        axis.set_title(title)
        axis.set_xlabel("iteration")
    figure.tight_layout()
    save_figure_atomically(figure, Path(png), dpi=80)
    plt.close(figure)
    return png
