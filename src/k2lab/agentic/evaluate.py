"""Batched, greedy evaluation of a local model on an agentic environment.

    report = evaluate_policy(model, tokenizer, env, seeds=range(1000, 1200), batch_size=32)
    report["success"], report["ci95"], report["no_tool_calls"], report["tokens_per_task"], report["domains"]

All episodes start together; at each step every unfinished episode plays its next turn, so episodes of
the same turn index go through ``generate`` together (sub-batches of ``batch_size`` rows, sorted by prompt
length to keep padding small), each row with its own tool-call enforcer constraint. Decoding is greedy,
and a turn is handled exactly as ``k2lab.agentic.rollout.run_episode`` handles it with a ``LocalPolicy``
at temperature 0 (truncated / malformed output and context overflow end the episode with that reason), so
the batched evaluator gives the outcomes of evaluating the episodes one at a time.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from k2lab.agentic.env import Environment, Episode
from k2lab.agentic.rollout import IM_END, LocalPolicy, PolicyOutputError, parse_reply

__all__ = ["episode_summary", "evaluate_policy", "summarize", "wilson_interval"]

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
    episodes = play_batched(model, tokenizer, env, list(seeds), batch_size, max_new_tokens, tool_format)
    report = summarize([episode_summary(e) for e in episodes])
    report["seconds"] = round(time.perf_counter() - started, 3)
    return report


def play_batched(
    model: Any,
    tokenizer: Any,
    env: Environment,
    seeds: Sequence[int],
    batch_size: int = 32,
    max_new_tokens: int = 128,
    tool_format: str = "typescript",
    on_turn: Callable[[Episode, list[int], list[int]], None] | None = None,
) -> list[Episode]:
    """The finished episodes of ``seeds`` (in order), played turn by turn in batches; ``on_turn(episode,
    prompt_ids, completion_ids)`` sees every generated turn (before the environment steps)."""
    policy = LocalPolicy(
        model, tokenizer, temperature=0.0, max_new_tokens=max_new_tokens, tool_format=tool_format
    )
    episodes = [env.reset(seed) for seed in seeds]
    was_training = model.training
    model.eval()
    try:
        while True:
            active = [e for e in episodes if not _close_if_over(e)]
            if not active:
                break
            _play_turn(env, policy, active, batch_size, on_turn)
    finally:
        model.train(was_training)
    return episodes


def _close_if_over(episode: Episode) -> bool:
    """True when the episode is done (finishing it at its turn limit, as ``run_episode`` does)."""
    if not episode.done and episode.turns >= episode.max_turns:
        episode.finish(False, "max turns", reward=0.0)
    return episode.done


def _play_turn(
    env: Environment,
    policy: LocalPolicy,
    episodes: list[Episode],
    batch_size: int,
    on_turn: Callable[[Episode, list[int], list[int]], None] | None = None,
) -> None:
    """One turn of every episode: prompts, batched greedy generation, parsing, ``env.step``."""
    limit = getattr(policy.model.config, "max_position_embeddings", None)
    rows = []
    for episode in episodes:
        prompt = policy.encode_prompt(episode.messages, episode.tools)
        if limit is not None and len(prompt) + policy.max_new_tokens > limit:
            _fail(episode, PolicyOutputError("context overflow", (), f"{len(prompt)} prompt tokens"))
            continue
        rows.append((episode, prompt))
    rows.sort(key=lambda row: len(row[1]))
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        outputs = _generate(policy, [prompt for _, prompt in chunk], [e.tools for e, _ in chunk])
        for (episode, prompt), ids in zip(chunk, outputs, strict=True):
            if on_turn is not None:
                on_turn(episode, prompt, ids)
            _apply(env, policy, episode, ids)


def _generate(
    policy: LocalPolicy, prompts: list[list[int]], tools: list[list[dict[str, Any]]]
) -> list[list[int]]:
    from k2lab.infer.generate import GenerationConfig, generate

    config = GenerationConfig(
        max_new_tokens=policy.max_new_tokens, temperature=0.0, eos_token_id=policy.im_end, seed=0
    )
    constraints = [policy._grammar(t).constraint() for t in tools]
    return generate(policy.model, prompts, config, constraints=constraints)


def _apply(env: Environment, policy: LocalPolicy, episode: Episode, ids: list[int]) -> None:
    """Record the generated ids and step the environment (or end the episode as ``run_episode`` would)."""
    episode.completion_tokens += len(ids)
    if not ids or ids[-1] != policy.im_end:
        _fail(
            episode, PolicyOutputError("truncated", ids, f"no {IM_END} within {policy.max_new_tokens} tokens")
        )
        return
    try:
        message = parse_reply(policy.tokenizer.decode(ids))
    except PolicyOutputError as error:
        _fail(episode, error)
        return
    try:
        env.step(episode, message)
    except Exception as error:  # noqa: BLE001 - same handling as run_episode
        episode.finish(False, "environment error", reward=0.0, error=f"{type(error).__name__}: {error}"[:500])


def _fail(episode: Episode, error: PolicyOutputError) -> None:
    episode.turns += 1
    episode.finish(False, error.reason, reward=0.0, error=error.detail[:500])


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
