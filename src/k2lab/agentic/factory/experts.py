"""Expert policies for the factory: procedural agents that know each task's plan, and an LLM agent.

``ExpertAgent.act(episode)`` returns the next OpenAI-format assistant message for a ``ToolTaskEnvironment``
episode. It reads the task (phases, plan, expected answers) from ``episode.state`` and works out where the
conversation stands from the messages of the current phase:

1. ask for a held-back detail (the clarification) if the user has not given it yet;
2. make the plan's calls one per turn (ids ``functions.{name}:{idx}``, arguments as JSON text, written in
   the agent's tool variant through ``SyntheticTool.encode``); a call answered with a transient error, a
   rate limit, a partial or an empty result is retried (up to ``max_retries`` times); a domain error the
   plan did not expect ends the phase with an apology;
3. answer with the phase's expected answer (a short natural-language confirmation).

With probability ``imperfection`` per task the expert makes one deliberate mistake (``MODES``, chosen by
the episode seed): ``wrong_argument``, ``skipped_step``, ``unnecessary_call``, ``premature_answer`` or
``unnecessary_question``, so the judge has failing trajectories to reject. ``mode=`` forces one.
"""

from __future__ import annotations

import json
import random
from typing import Any

from k2lab.agentic.domains.base import DAYS, Phase, Step
from k2lab.agentic.domains.math import LENGTH_UNITS
from k2lab.agentic.episodes.env import Episode
from k2lab.agentic.factory.simulator import invent_value
from k2lab.agentic.factory.tasks import Task
from k2lab.agentic.factory.tools import ToolRepository
from k2lab.runtime.chat import tool_call_id

__all__ = ["EXPECTED_REASONS", "MODES", "ExpertAgent", "LLMAgent"]

MODES = ("wrong_argument", "skipped_step", "unnecessary_call", "premature_answer", "unnecessary_question")
EXPECTED_REASONS = {
    "wrong_argument": {"final_state", "confirmation"},
    "skipped_step": {"final_state", "confirmation"},
    "unnecessary_call": {"unnecessary_tool_call", "tool_on_no_tool_task"},
    "premature_answer": {"final_state", "confirmation"},
    "unnecessary_question": {"unnecessary_question"},
}
PERTURB_ORDER = (
    "qty",
    "amount",
    "hour",
    "day",
    "value",
    "account",
    "source",
    "target",
    "item",
    "sku",
    "path",
    "title",
    "expression",
    "passenger",
    "flight_id",
    "booking_id",
    "address",
    "numbers",
    "op",
    "origin",
    "destination",
    "from_unit",
    "to_unit",
    "query",
)
GENERIC_ANSWER = "All done, I've taken care of that for you."
EXTRA_QUESTION = "Before I start: shall I go ahead exactly as you described?"


class ExpertAgent:
    """A procedural expert for ``ToolTaskEnvironment`` episodes (see the module docstring)."""

    def __init__(
        self,
        repository: ToolRepository,
        imperfection: float = 0.0,
        mode: str | None = None,
        max_retries: int = 4,
    ):
        if mode is not None and mode not in MODES:
            raise ValueError(f"unknown imperfection mode {mode!r}; expected one of {', '.join(MODES)}")
        self.repository = repository
        self.imperfection = imperfection
        self.mode = mode
        self.max_retries = max_retries

    def mode_for(self, episode: Episode) -> str | None:
        """The mistake this episode gets (None: a clean run), deterministic in the episode seed."""
        if self.mode is not None:
            return self.mode
        rng = random.Random(f"expert:{episode.seed}")
        return rng.choice(MODES) if rng.random() < self.imperfection else None

    def __call__(self, episode: Episode) -> dict[str, Any]:
        return self.act(episode)

    def act(self, episode: Episode) -> dict[str, Any]:
        """The next assistant message."""
        task = Task.from_dict(episode.state["task"])
        index = episode.state["phase"]
        phase = task.phases[index]
        target = next((i for i, p in enumerate(task.phases) if p.steps), 0)
        mode = self.mode_for(episode) if index == target else None
        recent = episode.messages[episode.state["phase_start"] :]
        if phase.clarification and not episode.state["clarified"] and not _asked(recent, phase):
            return _say(phase.clarification.question)
        if mode == "unnecessary_question" and EXTRA_QUESTION not in _texts(recent):
            return _say(EXTRA_QUESTION)
        if mode == "unnecessary_call" and not self._extra_done(task, recent):
            return self._extra_call(task, episode, phase)
        return self._next(task, phase, episode, recent, mode)

    # ------------------------------------------------------------------------------------- the plan

    def _next(self, task: Task, phase: Phase, episode: Episode, recent: list[dict], mode: str | None) -> dict:
        steps = phase.steps[:-1] if mode == "skipped_step" and phase.steps else phase.steps
        if not task.needs_tools and mode in ("wrong_argument", "skipped_step"):
            return _say("I'm not sure, sorry.")
        done, retries, failure = self._progress(task, steps, recent)
        if failure is not None:
            return _say(f"Sorry, I couldn't complete that: {failure}.")
        premature_at = 0 if len(steps) <= 1 else 1
        if mode == "premature_answer" and done >= premature_at:
            return _say(GENERIC_ANSWER)
        if done >= len(steps):
            return _say(phase.answer)
        if retries > self.max_retries:
            return _say("Sorry, the service keeps failing right now; please try again later.")
        step = steps[done]
        args = (
            self._perturbed(step, episode)
            if mode == "wrong_argument" and done == _perturb_index(steps)
            else step.args
        )
        return self._call(task, step.tool, args, episode)

    def _progress(self, task: Task, steps: list[Step], recent: list[dict]) -> tuple[int, int, str | None]:
        """``(steps done, retries of the current step, unexpected error)`` from the phase's exchanges."""
        done, retries = 0, 0
        for name, result in _exchanges(recent):
            if done >= len(steps) or name != task.agent.tools.get(steps[done].tool):
                continue
            error = result.get("error") if isinstance(result, dict) else None
            if (
                isinstance(error, dict)
                and error.get("retryable")
                or result.get("partial")
                or result.get("empty")
            ):
                retries += 1
            elif isinstance(error, dict) and error.get("type") != steps[done].expect_error:
                return done, retries, str(error.get("message") or error.get("type"))
            else:
                done, retries = done + 1, 0
        return done, retries, None

    def _call(self, task: Task, tool: str, args: dict[str, Any], episode: Episode) -> dict[str, Any]:
        name = task.agent.tools[tool]
        synthetic = self.repository.synthetic.get(name)
        arguments = synthetic.encode(args) if synthetic is not None else args
        return _tool_message(name, arguments, episode.tool_calls)

    # --------------------------------------------------------------------------------- imperfections

    def _perturbed(self, step: Step, episode: Episode) -> dict[str, Any]:
        args = dict(step.args)
        key = next((k for k in PERTURB_ORDER if k in args), next(iter(args), None))
        if key is not None:
            args[key] = _perturb(key, args[key], episode.state["world"])
        return args

    def _extra_candidates(self, task: Task) -> list[str]:
        planned = {task.agent.tools[s.tool] for p in task.phases for s in p.steps}
        names = [n for n in task.agent.tool_names if n not in planned]
        read_only = [
            n for n in names if n in self.repository.synthetic and self.repository.synthetic[n].base.read_only
        ]
        return read_only or names

    def _extra_done(self, task: Task, recent: list[dict]) -> bool:
        candidates = set(self._extra_candidates(task))
        return not candidates or any(name in candidates for name, _ in _exchanges(recent))

    def _extra_call(self, task: Task, episode: Episode, phase: Phase) -> dict[str, Any]:
        candidates = self._extra_candidates(task)
        name = random.Random(f"extra:{episode.seed}").choice(candidates)
        parameters = self.repository.spec(name)["function"].get("parameters") or {}
        required = set(parameters.get("required") or [])
        schema = {
            **parameters,
            "properties": {k: v for k, v in (parameters.get("properties") or {}).items() if k in required},
        }
        arguments = invent_value(schema, random.Random(f"extra-args:{episode.seed}")) or {}
        return _tool_message(name, arguments, episode.tool_calls)


def _perturb_index(steps: list[Step]) -> int:
    """The step whose arguments a ``wrong_argument`` expert gets wrong: the last one with arguments."""
    with_args = [i for i, step in enumerate(steps) if step.args]
    return with_args[-1] if with_args else -1


def _perturb(key: str, value: Any, world: dict[str, Any]) -> Any:
    """A plausible but wrong value."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 10.0
    if isinstance(value, list):
        return [*value, 1.0]
    if key in ("account", "source", "target"):
        return _other(sorted(world["bank"]["accounts"]), value)
    if key == "item":
        return _other(sorted(world["retail"]["catalog"]), value)
    if key == "day":
        return _other(list(DAYS), value)
    if key in ("from_unit", "to_unit"):
        return _other(sorted(LENGTH_UNITS), value)
    if key == "expression":
        return f"{value} + 1"
    if key == "op":
        return _other(["mean", "median", "max", "min", "sum"], value)
    return f"copy_of_{value}" if key == "path" else f"{value} 2"


def _other(options: list[Any], value: Any) -> Any:
    return options[(options.index(value) + 1) % len(options)] if value in options else options[0]


# ------------------------------------------------------------------------------------------ messages


def _say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _tool_message(name: str, arguments: dict[str, Any], index: int) -> dict[str, Any]:
    call = {
        "id": tool_call_id(name, index),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _texts(messages: list[dict[str, Any]]) -> list[str]:
    return [str(m.get("content") or "") for m in messages if m.get("role") == "assistant"]


def _asked(messages: list[dict[str, Any]], phase: Phase) -> bool:
    return phase.clarification is not None and phase.clarification.question in _texts(messages)


def _exchanges(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(tool name, parsed result)`` of every tool call answered in ``messages``, in order."""
    names: dict[str, str] = {}
    out = []
    for message in messages:
        for call in message.get("tool_calls") or []:
            names[call.get("id")] = call["function"]["name"]
        if message.get("role") == "tool" and message.get("tool_call_id") in names:
            try:
                result = json.loads(message.get("content") or "{}")
            except ValueError:
                result = {}
            out.append((names[message["tool_call_id"]], result if isinstance(result, dict) else {}))
    return out


class LLMAgent:
    """A policy served by any OpenAI-compatible endpoint (``openai`` client, configurable ``base_url``):
    ``act(episode)`` sends the conversation and the tools, returns the assistant message. Optional."""

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, **sampling: Any):
        from openai import OpenAI  # lazy: optional dependency openai

        self.model = model
        self.client = OpenAI(base_url=base_url, api_key=api_key or "EMPTY")
        self.sampling = sampling

    def __call__(self, episode: Episode) -> dict[str, Any]:
        return self.act(episode)

    def act(self, episode: Episode) -> dict[str, Any]:
        response = self.client.chat.completions.create(
            model=self.model, messages=episode.messages, tools=episode.tools or None, **self.sampling
        )
        message = response.choices[0].message
        out: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
                for call in message.tool_calls
            ]
        return out
