"""K2's agentic data factory, procedural by default: tools -> agents -> tasks -> rollouts -> judge -> JSONL.

``generate(config)`` builds the tool repository (synthetic tools evolved over the domain hierarchy, plus
harvested MCP tools when given), rolls out ``n`` tasks of ``ToolTaskEnvironment`` with ``ExpertAgent``
(optionally imperfect) in the stateful simulator (optionally failing), judges each trajectory against its
rubric and keeps the rubric-satisfying ones. ``write`` saves them as OpenAI-format conversations, one
``{"messages", "tools", "task_id", "domain", "needs_tools", "rubric", ...}`` per line (atomically), and the
summary next to them (``<out stem>.summary.json``). Everything runs on CPU without an external model.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from rich.table import Table

from k2lab.agentic.episodes.env import Episode
from k2lab.agentic.factory.experts import ExpertAgent
from k2lab.agentic.factory.judge import reason_category
from k2lab.agentic.factory.simulator import FailureRates
from k2lab.agentic.factory.tasks import ToolTaskEnvironment
from k2lab.agentic.factory.tools import build_repository
from k2lab.fsutil import atomic_write_text
from k2lab.runtime.chat import normalize_messages

__all__ = ["FactoryConfig", "FactoryResult", "generate", "print_summary", "rollout", "summary_path_for"]


class FactoryConfig(BaseModel):
    """What to generate: ``n`` tasks from ``seed`` (``k2lab factory generate``); rates in [0, 1]."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(default=100, ge=1, description="Tasks to roll out.")
    seed: int = Field(default=0, description="Seed of the tool evolution, tasks and failures.")
    tools_path: Path | None = Field(
        default=None, description="Harvested MCP tools (JSONL of `k2lab tools harvest`)."
    )
    failure_rate: float = Field(
        default=0.1, ge=0, le=1, description="Injected failures per call (errors, rate limits, edge cases)."
    )
    imperfection: float = Field(
        default=0.2, ge=0, le=1, description="Share of tasks where the expert makes one mistake."
    )
    no_tool_fraction: float = Field(
        default=0.15, ge=0, le=1, description="Share of tasks that need no tool at all."
    )
    mcp_fraction: float = Field(
        default=0.2, ge=0, le=1, description="Share of tasks for harvested MCP tools (with tools_path)."
    )
    variants_per_tool: int = Field(
        default=12, ge=0, description="Evolved variants of every base tool (0: canonical names only)."
    )
    max_distractors: int = Field(
        default=2, ge=0, description="Tools of other domains an agent may also hold."
    )


@dataclass
class FactoryResult:
    """Kept trajectories (output records), every episode's outcome and the summary."""

    kept: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def write(self, out: str | Path) -> Path:
        """Write the JSONL and the summary (each atomically); returns the summary's path."""
        out = Path(out)
        atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.kept))
        path = summary_path_for(out)
        atomic_write_text(path, json.dumps({"output": str(out), **self.summary}, indent=2) + "\n")
        return path


def summary_path_for(out: Path) -> Path:
    """``trajectories.jsonl`` -> ``trajectories.summary.json``."""
    return out.with_name(f"{out.stem}.summary.json")


def rollout(env: ToolTaskEnvironment, policy: Any, seed: int) -> Episode:
    """One episode of ``env`` driven by ``policy(episode) -> assistant message`` to its end."""
    episode = env.reset(seed)
    while not episode.done:
        env.step(episode, policy(episode))
    return episode


def record(episode: Episode) -> dict[str, Any]:
    """The output line of a kept episode: the conversation in OpenAI format plus task metadata."""
    task = episode.state["task"]
    return {
        "messages": normalize_messages(episode.messages),
        "tools": episode.tools,
        "task_id": episode.task_id,
        "domain": task["domain"],
        "kind": task["kind"],
        "needs_tools": episode.needs_tools,
        "rubric": task["rubric"],
        "agent_id": task["agent"]["agent_id"],
        "seed": episode.seed,
    }


def generate(config: FactoryConfig) -> FactoryResult:
    """Roll out, judge and keep (see the module docstring)."""
    started = time.perf_counter()
    repository = build_repository(config.seed, config.variants_per_tool, config.tools_path)
    env = ToolTaskEnvironment(
        repository,
        FailureRates.from_total(config.failure_rate),
        config.no_tool_fraction,
        config.mcp_fraction,
        max_distractors=config.max_distractors,
    )
    expert = ExpertAgent(repository, imperfection=config.imperfection)
    result, stats = FactoryResult(), _Stats()
    for index in range(config.n):
        seed = config.seed * 1_000_003 + index
        episode = rollout(env, expert, seed)
        stats.add(episode, expert.mode_for(episode))
        if episode.outcome is not None and episode.outcome.success:
            result.kept.append(record(episode))
    result.summary = stats.summary(config, repository, time.perf_counter() - started)
    return result


@dataclass
class _Stats:
    """Counters over all episodes and over the kept ones."""

    episodes: int = 0
    kept: int = 0
    reasons: Counter = field(default_factory=Counter)
    modes: Counter = field(default_factory=Counter)
    modes_kept: Counter = field(default_factory=Counter)
    domains: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    observations: Counter = field(default_factory=Counter)
    tools: set = field(default_factory=set)
    needs_tools: Counter = field(default_factory=Counter)
    turns: list = field(default_factory=list)
    calls: list = field(default_factory=list)

    def add(self, episode: Episode, mode: str | None) -> None:
        self.episodes += 1
        self.modes[mode or "none"] += 1
        self.observations.update(call["kind"] for call in episode.state["calls"])
        success = episode.outcome is not None and episode.outcome.success
        if not success:
            reasons = episode.outcome.details.get("reasons", []) if episode.outcome else []
            self.reasons.update({reason_category(r) for r in reasons} or {"unknown"})
            return
        self.kept += 1
        self.modes_kept[mode or "none"] += 1
        self.domains[episode.state["task"]["domain"]] += 1
        self.kinds[episode.state["task"]["kind"]] += 1
        self.needs_tools["tools" if episode.needs_tools else "no_tools"] += 1
        self.tools.update(str(call["tool"]) for call in episode.state["calls"])
        self.turns.append(episode.turns)
        self.calls.append(episode.tool_calls)

    def summary(self, config: FactoryConfig, repository: Any, seconds: float) -> dict[str, Any]:
        return {
            "episodes": self.episodes,
            "kept": self.kept,
            "rejected": self.episodes - self.kept,
            "rejected_by_reason": dict(self.reasons.most_common()),
            "imperfection_modes": dict(self.modes.most_common()),
            "kept_by_mode": dict(self.modes_kept.most_common()),
            "domains": dict(self.domains.most_common()),
            "task_kinds": dict(self.kinds.most_common()),
            "needs_tools": dict(self.needs_tools),
            "tools_covered": len(self.tools),
            "repository_tools": len(repository),
            "repository_hierarchy": repository.hierarchy(),
            "mcp_tools": len(repository.mcp),
            "observations": dict(self.observations.most_common()),
            "turns": _describe(self.turns),
            "tool_calls_per_trajectory": _describe(self.calls),
            "seconds": round(seconds, 3),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.model_dump().items()},
        }


def _describe(values: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "min": 0, "max": 0}
    return {"mean": round(statistics.fmean(values), 3), "min": min(values), "max": max(values)}


def print_summary(summary: dict[str, Any], console: Any) -> None:
    """The summary as rich tables."""
    table = Table(title=f"agentic data factory: kept {summary['kept']} of {summary['episodes']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("kept", summary["kept"]),
        ("rejected", summary["rejected"]),
        ("tools in repository", summary["repository_tools"]),
        ("tools covered (kept)", summary["tools_covered"]),
        ("turns (mean / max)", f"{summary['turns']['mean']} / {summary['turns']['max']}"),
        (
            "tool calls per trajectory (mean / max)",
            f"{summary['tool_calls_per_trajectory']['mean']} / {summary['tool_calls_per_trajectory']['max']}",
        ),
        ("no-tool trajectories kept", summary["needs_tools"].get("no_tools", 0)),
        ("seconds", summary["seconds"]),
    ]
    for name, value in rows:
        table.add_row(name, str(value))
    console.print(table)
    for title, key in (
        ("rejected by reason", "rejected_by_reason"),
        ("kept by domain", "domains"),
        ("imperfection modes", "imperfection_modes"),
        ("tool observations", "observations"),
    ):
        counts = Table(title=title)
        counts.add_column("name")
        counts.add_column("count", justify="right")
        for name, count in summary[key].items():
            counts.add_row(str(name), str(count))
        console.print(counts)
