"""Batched, greedy evaluation of a local model on an agentic environment.

    report = evaluate_policy(model, tokenizer, env, seeds=range(1000, 1200), batch_size=32)
    report["success"], report["ci95"], report["no_tool_calls"], report["tokens_per_task"], report["domains"]

All episodes start together and play through ``k2lab.agentic.episodes.rollout.run_episodes``: at each round
every unfinished episode plays its next turn, so episodes of the same turn index go through ``generate``
together (sub-batches of ``batch_size`` rows, sorted by prompt length to keep padding small), each row with
its own tool-call enforcer constraint. Decoding is greedy, and a turn is handled exactly as ``run_episode``
handles it (truncated / malformed output and context overflow end the episode with that reason), so the
batched evaluator gives the outcomes of evaluating the episodes one at a time.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from k2lab.agentic.episodes.env import Environment, Episode
from k2lab.agentic.episodes.rollout import LocalPolicy, Rollout, run_episodes

__all__ = [
    "episode_summary",
    "evaluate_policy",
    "paired_comparison",
    "play_greedy",
    "summarize",
    "wilson_interval",
]

Z95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion ((0, 1) for n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    low = 0.0 if successes == 0 else max(0.0, center - half)  # exact ends at p = 0 and p = 1
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def paired_comparison(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Two models on the same tasks (``episode_summary`` rows, matched by seed): the tasks only ``after``
    solves, the tasks only ``before`` solves, and McNemar's exact two-sided p-value,

        p = min(1, 2 · Σ_{i ≤ min(b, c)} C(b + c, i) / 2^(b+c))      (b, c: the two discordant counts),

    the chance of a split at least this uneven if neither model were better. A paired test sees a
    difference that two overlapping intervals hide: the tasks both models solve (or fail) carry no signal.
    """
    solved_before = {row["seed"]: bool(row["success"]) for row in before}
    solved_after = {row["seed"]: bool(row["success"]) for row in after}
    if solved_before.keys() != solved_after.keys():
        raise ValueError("a paired comparison needs both models on the same task seeds")
    only_after = sum(solved_after[s] and not solved_before[s] for s in solved_before)
    only_before = sum(solved_before[s] and not solved_after[s] for s in solved_before)
    discordant = only_after + only_before
    tail = sum(math.comb(discordant, i) for i in range(min(only_after, only_before) + 1))
    return {
        "tasks": len(solved_before),
        "only_after": only_after,
        "only_before": only_before,
        "p_value": min(1.0, 2 * tail / 2**discordant) if discordant else 1.0,
    }


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    env: Environment,
    seeds: Iterable[int],
    batch_size: int = 32,
    max_new_tokens: int = 128,
    tool_format: str = "typescript",
) -> dict[str, Any]:
    """Play episode ``seed`` of ``env`` for every seed with greedy decoding, batched by turn; the report."""
    started = time.perf_counter()
    rollouts = play_greedy(model, tokenizer, env, list(seeds), batch_size, max_new_tokens, tool_format)
    episodes = [r.episode for r in rollouts]
    report = summarize([episode_summary(e) for e in episodes])
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def play_greedy(
    model: Any,
    tokenizer: Any,
    env: Environment,
    seeds: Sequence[int],
    batch_size: int = 32,
    max_new_tokens: int = 128,
    tool_format: str = "typescript",
) -> list[Rollout]:
    """The rollouts (episodes with their turns' ids) of ``seeds``, greedy, batched by turn
    (``k2lab.agentic.episodes.rollout.run_episodes``)."""
    policy = LocalPolicy(
        model, tokenizer, temperature=0.0, max_new_tokens=max_new_tokens, tool_format=tool_format
    )
    rollouts = [Rollout(env.reset(seed)) for seed in seeds]
    return run_episodes(env, policy, rollouts, [0] * len(rollouts), batch_size=batch_size)


# ------------------------------------------------------------------------------------------ reports


def episode_summary(episode: Episode) -> dict[str, Any]:
    """The per-episode facts a report aggregates."""
    task = episode.state.get("task", {})
    return {
        "seed": episode.seed,
        "task_id": episode.task_id,
        "domain": task.get("domain", episode.env),
        "needs_tools": episode.needs_tools,
        "success": bool(episode.outcome and episode.outcome.success),
        "reason": episode.outcome.reason if episode.outcome else "unfinished",
        "turns": episode.turns,
        "tool_calls": episode.tool_calls,
        "tokens": episode.completion_tokens,
    }


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Success with its Wilson 95 % interval, tool calls on no-tool tasks, tokens per task, per domain."""
    n, wins = len(rows), sum(r["success"] for r in rows)
    low, high = wilson_interval(wins, n)
    no_tool = [r for r in rows if not r["needs_tools"]]
    domains: dict[str, list[bool]] = defaultdict(list)
    reasons: dict[str, int] = defaultdict(int)
    for row in rows:
        domains[row["domain"]].append(row["success"])
        if not row["success"]:
            reasons[row["reason"]] += 1
    return {
        "tasks": n,
        "successes": wins,
        "success": wins / n if n else 0.0,
        "ci95": [low, high],
        "no_tool_tasks": len(no_tool),
        "no_tool_calls": _mean([r["tool_calls"] for r in no_tool]),
        "no_tool_success": _mean([float(r["success"]) for r in no_tool]),
        "tokens_per_task": _mean([r["tokens"] for r in rows]),
        "tool_calls_per_task": _mean([r["tool_calls"] for r in rows]),
        "domains": {d: {"tasks": len(v), "success": sum(v) / len(v)} for d, v in sorted(domains.items())},
        "failures": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "episodes": list(rows),
    }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
