"""One interface for every agentic environment: factory tool tasks, RL environments, evaluations.

An episode is a conversation in OpenAI message format (``k2lab.runtime.chat`` renders it in K2's format):

    env = SomeEnvironment(...)
    episode = env.reset(seed)                     # system/user messages, tools, budget
    while not episode.done:
        message = policy(episode.messages, episode.tools)        # an assistant message (may call tools)
        env.step(episode, message)                # appends the message, tool results, maybe a user turn
    episode.reward, episode.outcome               # set when done: reward in [0, 1] (before penalties)

``step`` never raises on bad model output: a malformed tool call, an unknown tool, invalid arguments,
a tool that raises or hangs end the episode (or return an error observation) with ``outcome.reason``
saying why. Episodes are plain data (JSON-serialisable through ``to_dict`` / ``from_dict``) so partial
rollouts can be persisted and resumed in a later RL iteration or after a crash.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Environment", "Episode", "Outcome", "tool_call_parts"]


@dataclass
class Outcome:
    """How an episode ended: ``success`` (the task's verifier passed), ``reason`` ("solved", "wrong answer",
    "malformed tool call", "tool error", "timeout", "budget", ...), and details for reports."""

    success: bool
    reason: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """The state of one rollout. ``state`` is the environment's own JSON-able world state (a store's
    inventory, a calendar, a sandbox snapshot path ...); ``turns`` counts assistant messages."""

    env: str
    seed: int
    task_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8
    token_budget: int | None = None  # completion tokens the task should need at most
    needs_tools: bool = True  # False: a tool call is unnecessary (the "tools hurt" tasks)
    turns: int = 0
    tool_calls: int = 0
    completion_tokens: int = 0
    done: bool = False
    reward: float | None = None
    outcome: Outcome | None = None

    def finish(self, success: bool, reason: str, reward: float | None = None, **details: Any) -> None:
        self.done = True
        self.reward = float(success) if reward is None else reward
        self.outcome = Outcome(success, reason, details)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Episode:
        data = dict(data)
        outcome = data.pop("outcome", None)
        episode = cls(**data)
        episode.outcome = Outcome(**outcome) if outcome else None
        return episode


class Environment(ABC):
    """A family of tasks with a verifier. Subclasses set ``name`` and implement ``reset`` and ``step``."""

    name: str = "environment"

    @abstractmethod
    def reset(self, seed: int) -> Episode:
        """A new episode for task ``seed`` (deterministic in the seed)."""

    @abstractmethod
    def step(self, episode: Episode, message: dict[str, Any]) -> None:
        """Apply one assistant message: append it, run its tool calls (appending ``role: tool`` results),
        verify, and set ``episode.done`` / ``reward`` / ``outcome`` when the episode ends."""


def tool_call_parts(call: object) -> tuple[str, dict[str, Any], str | None]:
    """(name, arguments, problem) of one OpenAI tool call."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        return "", {}, "a tool call must be {'function': {'name': str, 'arguments': str}}"
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except (ValueError, RecursionError) as error:
            return function["name"], {}, f"arguments are not JSON ({error})"
    if not isinstance(arguments, dict):
        return function["name"], {}, "arguments must be a JSON object"
    return function["name"], arguments, None
