"""Agents, tool-matched tasks with explicit rubrics, user simulators and ``ToolTaskEnvironment``.

An **agent** is a domain, a system prompt (one of several styles) and a tool subset: one evolved variant of
every base tool of the domain plus a few distractors from other domains. A **task** is what a user wants
from that agent, in one or more **phases** (a follow-up request after the first answer makes it
multi-turn); a phase may hold back a detail (the quantity, the hour, the passenger) that the agent has to
ask for, and the user simulator answers from the task's hidden details. The task templates that draw them
are written in the domain modules (``k2lab.agentic.domains``), the no-tool ones in
``k2lab.agentic.domains.no_tool``; this module samples agents and templates, draws tasks for harvested MCP
tools, and attaches the rubric. Each task carries its **plan** (the canonical calls that solve it, run once
on a copy of the world at generation time so every task is feasible and its expected answers are known)
and a **rubric**:

* final-state checks on the world (the domain's own kinds, e.g. ``order_placed``, ``event_at``,
  ``balance``, ``booking``; ``unchanged``) and ``called`` (a call with exactly these canonical arguments
  was made: answers must be grounded in the right lookup);
* trajectory items: ``finished`` (answered before the turn limit), ``confirmed_result`` (the final answer
  names the key facts), ``no_unnecessary_questions``, ``only_needed_tools`` and, for no-tool tasks
  (chit-chat, questions answerable directly), ``no_tool_calls``.

``ToolTaskEnvironment`` runs such tasks behind ``k2lab.agentic.episodes.env.Environment``;
``k2lab.agentic.factory.judge`` checks the rubric. The world, its initial copy, the task and a log of calls
live in ``episode.state``.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from k2lab.agentic.domains import BASES, DOMAINS, initial_world
from k2lab.agentic.domains.base import Clarification, Draft, Phase, Step, ToolError
from k2lab.agentic.domains.no_tool import no_tool_task
from k2lab.agentic.episodes.env import Environment, Episode
from k2lab.agentic.factory.judge import judge_episode
from k2lab.agentic.factory.simulator import FailureRates, ToolSimulator, error_observation, invent_value
from k2lab.agentic.factory.tools import SyntheticTool, ToolRepository, build_repository
from k2lab.errors import K2LabError
from k2lab.runtime.chat import tool_call_id
from k2lab.runtime.tool_spec import json_schema_problems, schema_validator

__all__ = [
    "Agent",
    "LLMUserSimulator",
    "ScriptedUserSimulator",
    "Task",
    "TaskGenerator",
    "MINI_TOOLS",
    "ToolTaskEnvironment",
    "tool_env",
]

PERSONAS = ("Ava", "Milo", "Noor", "Kai", "Lena", "Ravi")
PROMPT_STYLES = (
    "You are {persona}, an assistant for {desc}. Use the tools to act on the user's behalf and confirm "
    "what you did.",
    "You help users with {desc}. Only call a tool when it is needed, and keep answers short.",
    "You are a concise operations agent for {desc}. Do not ask for information the user already gave; "
    "retry a tool when the service is briefly unavailable.",
    "System: {desc}. Act through the available functions. Report results plainly, with the numbers.",
)


# ------------------------------------------------------------------------------------------- data types


@dataclass
class Agent:
    """A domain, a system prompt and tools: ``tools`` maps base key (or MCP name) -> tool name;
    ``distractors`` are tool names outside the domain."""

    agent_id: str
    domain: str
    system_prompt: str
    tools: dict[str, str]
    distractors: list[str] = field(default_factory=list)

    @property
    def tool_names(self) -> list[str]:
        return [*self.tools.values(), *self.distractors]


@dataclass
class Task:
    """A task for an agent: phases (with the plan), the rubric, and whether tools are needed at all."""

    task_id: str
    seed: int
    domain: str
    kind: str
    agent: Agent
    phases: list[Phase]
    rubric: dict[str, Any]
    needs_tools: bool = True
    max_turns: int = 8

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        data = copy.deepcopy(data)
        data["agent"] = Agent(**data["agent"])
        phases = []
        for phase in data["phases"]:
            clarification = phase.get("clarification")
            phase["clarification"] = Clarification(**clarification) if clarification else None
            phase["steps"] = [Step(**step) for step in phase["steps"]]
            phases.append(Phase(**phase))
        data["phases"] = phases
        return cls(**data)


# ---------------------------------------------------------------------------------------- generation


class TaskGenerator:
    """Deterministic tasks (by seed) for agents sampled over a repository's domains and MCP tools."""

    def __init__(
        self,
        repository: ToolRepository,
        no_tool_fraction: float = 0.15,
        mcp_fraction: float = 0.2,
        max_distractors: int = 2,
        domains: Sequence[str] | None = None,
    ):
        self.repository = repository
        self.no_tool_fraction = no_tool_fraction
        self.mcp_fraction = mcp_fraction if repository.mcp else 0.0
        self.max_distractors = max_distractors
        self.tree = repository.by_domain()
        self.domains = sorted(domains or DOMAINS)
        unknown = sorted(set(self.domains) - set(DOMAINS))
        if unknown:
            raise ValueError(f"unknown tool domains {unknown}; choose from {', '.join(sorted(DOMAINS))}")
        _check_mcp_schemas(repository)

    def sample_agent(self, rng: random.Random, domain: str) -> Agent:
        """One variant per base tool of ``domain`` and up to ``max_distractors`` tools of other domains."""
        tools = {key: rng.choice(variants).name for key, variants in sorted(self.tree[domain].items())}
        others = sorted(name for name, tool in self.repository.synthetic.items() if tool.domain != domain)
        distractors = rng.sample(others, rng.randint(0, self.max_distractors))
        style = rng.choice(PROMPT_STYLES)
        prompt = style.format(persona=rng.choice(PERSONAS), desc=DOMAINS[domain].description)
        return Agent(f"{domain}-{rng.randrange(10**6):06d}", domain, prompt, tools, distractors)

    def generate(self, seed: int) -> tuple[Task, dict[str, Any]]:
        """The task for ``seed`` and its initial world."""
        rng = random.Random(f"task:{seed}")
        world = initial_world(rng)
        domain = rng.choice(self.domains)
        agent = self.sample_agent(rng, domain)
        draw = rng.random()
        if draw < self.no_tool_fraction:
            return self._finish(seed, agent, no_tool_task(rng, world), world, needs_tools=False)
        if draw < self.no_tool_fraction + self.mcp_fraction:
            mcp = self._mcp_task(rng, seed, world)
            if mcp is not None:
                return mcp
        draft = rng.choice(DOMAINS[domain].templates)(rng, world)
        return self._finish(seed, agent, draft, world)

    def _finish(
        self, seed: int, agent: Agent, draft: Draft, world: dict[str, Any], needs_tools: bool = True
    ) -> tuple[Task, dict[str, Any]]:
        _rehearse(draft, world, agent)
        rubric = _rubric(draft, agent, needs_tools)
        steps = sum(len(phase.steps) for phase in draft.phases)
        task = Task(
            f"{draft.kind}-{seed}",
            seed,
            agent.domain,
            draft.kind,
            agent,
            draft.phases,
            rubric,
            needs_tools,
            max_turns=4 + 5 * steps + 2 * len(draft.phases),
        )
        return task, world

    def _mcp_task(self, rng: random.Random, seed: int, world: dict[str, Any]) -> tuple[Task, dict] | None:
        """A task for a harvested tool: call it with given arguments and report back (None if no
        schema-valid arguments could be invented)."""
        names = sorted(self.repository.mcp)
        name = rng.choice(names)
        record = self.repository.mcp[name]
        schema = record["openai"]["function"].get("parameters") or {"type": "object", "properties": {}}
        args = invent_value({**schema, "properties": _required_only(schema)}, rng) or {}
        if list(schema_validator(schema).iter_errors(args)):
            return None
        server = record.get("server") or "mcp"
        same = [
            n for n in names if n != name and self.repository.mcp[n].get("server") == record.get("server")
        ]
        extra = rng.sample(same, min(len(same), rng.randint(0, 2)))
        prompt = rng.choice(PROMPT_STYLES).format(persona=rng.choice(PERSONAS), desc=f"the {server} tools")
        agent = Agent(f"mcp-{rng.randrange(10**6):06d}", f"mcp:{server}", prompt, {name: name}, extra)
        shown = ", ".join(f"{key}={json.dumps(value)}" for key, value in args.items()) or "no arguments"
        phase = Phase(
            f"Please run {name} with {shown} and tell me when it is done.",
            [Step(name, args)],
            f"Done: {name} completed successfully.",
        )
        draft = Draft("mcp_call", [phase], [])
        return self._finish(seed, agent, draft, world)


def _check_mcp_schemas(repository: ToolRepository) -> None:
    """Refuse harvested tools whose parameters cannot be checked (an invalid schema, or a ``$ref`` that
    does not resolve within it: remote ones are never fetched), naming the first, before any rollout."""
    for name, record in sorted(repository.mcp.items()):
        problems = json_schema_problems(record["openai"]["function"].get("parameters") or {})
        if problems:
            raise K2LabError(
                f"harvested tool {name!r} has unusable parameters: {problems[0]}; fix or remove it "
                "(k2lab tools harvest skips such tools)"
            )


def _required_only(schema: dict[str, Any]) -> dict[str, Any]:
    required = set(schema.get("required") or [])
    return {key: sub for key, sub in (schema.get("properties") or {}).items() if key in required}


def _rehearse(draft: Draft, world: dict[str, Any], agent: Agent) -> None:
    """Run the plan on a copy of the world with the canonical semantics: every step must succeed (or fail
    with its ``expect_error``), so generated tasks are feasible."""
    scratch = copy.deepcopy(world)
    for phase in draft.phases:
        for step in phase.steps:
            if step.tool not in BASES:
                continue
            try:
                BASES[step.tool].impl(scratch, copy.deepcopy(step.args))
            except ToolError as error:
                if error.kind != step.expect_error:
                    raise RuntimeError(f"infeasible task {draft.kind}: {error}") from error
            else:
                if step.expect_error:
                    raise RuntimeError(f"task {draft.kind} expected {step.expect_error}")


def _rubric(draft: Draft, agent: Agent, needs_tools: bool) -> dict[str, Any]:
    """Final-state checks (with ``called`` checks for every planned call) and trajectory items."""
    checks = list(draft.checks)
    for phase in draft.phases:
        for step in phase.steps:
            outcome = step.expect_error or "ok"
            checks.append(
                {
                    "kind": "called",
                    "tool": agent.tools[step.tool],
                    "args": step.args,
                    "outcome": outcome,
                    "description": f"{step.tool} was called with {json.dumps(step.args)} ({outcome})",
                }
            )
    questions = sum(phase.clarification is not None for phase in draft.phases)
    items: list[dict[str, Any]] = [
        {"kind": "finished", "description": "the assistant answered before the turn limit"},
        {
            "kind": "confirmed_result",
            "terms": [_key_terms(draft, i) for i in range(len(draft.phases))],
            "description": "each final answer confirms the result with its key facts",
        },
        {
            "kind": "no_unnecessary_questions",
            "max_questions": questions,
            "description": f"asked at most {questions} clarifying question(s)",
        },
    ]
    if needs_tools:
        allowed = sorted({agent.tools[step.tool] for phase in draft.phases for step in phase.steps})
        items.append(
            {"kind": "only_needed_tools", "allowed": allowed, "description": "called only needed tools"}
        )
    else:
        items.append({"kind": "no_tool_calls", "description": "answered directly without calling a tool"})
    return {"final_state": checks, "items": items}


def _key_terms(draft: Draft, index: int) -> list[str]:
    """Facts the phase's final answer must state: numbers, ids and names found in the expected answer."""
    phase = draft.phases[index]
    if phase.terms:
        return list(phase.terms)
    answer = phase.answer
    words = [word.strip(".,;:'!?") for word in answer.split()]
    facts = [w for w in words if any(ch.isdigit() for ch in w) or "-" in w or "." in w[1:-1]]
    return facts[:3] or [words[1]]


# ------------------------------------------------------------------------------------------ users


class ScriptedUserSimulator:
    """Answers the agent's questions from the task's hidden details; other questions get a go-ahead."""

    def reply(self, task: Task, phase: int, question: str, clarified: bool) -> tuple[str, bool]:
        """``(text, clarified)``: the user's reply and whether it gave the phase's held-back detail."""
        clarification = task.phases[phase].clarification
        lowered = question.lower()
        if clarification and not clarified and any(word in lowered for word in clarification.keywords):
            return clarification.answer, True
        return "Yes, please go ahead.", clarified


class LLMUserSimulator:
    """A user played by a model behind an OpenAI-compatible endpoint (``openai`` client, any
    ``base_url``); it knows the task's hidden details. Optional: the factory's default is scripted."""

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None):
        from openai import OpenAI  # lazy: optional dependency openai

        self.model = model
        self.client = OpenAI(base_url=base_url, api_key=api_key or "EMPTY")

    def reply(self, task: Task, phase: int, question: str, clarified: bool) -> tuple[str, bool]:
        clarification = task.phases[phase].clarification
        hidden = f" If asked, the missing detail is: {clarification.answer}" if clarification else ""
        system = (
            f"You are a user who asked an assistant: {task.phases[phase].request!r}.{hidden} "
            "Answer the assistant's question in one short sentence; never ask anything back."
        )
        response = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=64,
        )
        text = (response.choices[0].message.content or "").strip() or "Yes, please go ahead."
        gave = bool(clarification) and clarification.answer.rstrip(".").lower() in text.lower()
        return text, clarified or gave


# ------------------------------------------------------------------------------------------ environment


#: How a failed tool task earns partial credit (``ToolTaskEnvironment(credit=...)``).
CREDITS = ("checks", "progress")


def check_credit(credit: str) -> None:
    """Raise ``ValueError`` unless ``credit`` is one of ``CREDITS``."""
    if credit not in CREDITS:
        raise ValueError(f"credit must be one of {', '.join(CREDITS)}, got {credit!r}")


class ToolTaskEnvironment(Environment):
    """The factory's tool tasks behind the ``Environment`` interface (see the module docstring).

    ``step`` appends the assistant message, runs its tool calls in the simulator (appending ``role: tool``
    messages with the call's ``tool_call_id``), answers a question (a text-only turn ending in ``?``) with
    the user simulator, moves to the next phase's request after an answer, and judges the episode when the
    last phase is answered or ``max_turns`` is reached.

    ``domains`` restricts the tasks to some of the repository's domains, ``max_turns`` caps every task's turn
    limit. The reward is 1 for a trajectory that meets its whole rubric; otherwise ``partial_credit`` times
    (``credit``) the fraction of rubric checks it meets (``"checks"``) or the share of the reference solution
    it reproduced (``"progress"``: planned calls graded by their arguments and the answer's key facts,
    ``k2lab.agentic.factory.judge.solution_progress``; nothing for what doing nothing satisfies). The default
    partial credit of 0 rewards success only. A partial credit below 1 keeps every success above every failure
    while giving RL groups whose members all fail a signal to rank them by.
    """

    name = "tool_tasks"

    def __init__(
        self,
        repository: ToolRepository | None = None,
        rates: FailureRates | None = None,
        no_tool_fraction: float = 0.15,
        mcp_fraction: float = 0.2,
        user: ScriptedUserSimulator | LLMUserSimulator | None = None,
        max_distractors: int = 2,
        partial_credit: float = 0.0,
        domains: Sequence[str] | None = None,
        max_turns: int | None = None,
        credit: str = "checks",
    ):
        if not 0.0 <= partial_credit < 1.0:
            raise ValueError(f"partial_credit must be in [0, 1), got {partial_credit}")
        check_credit(credit)
        self.repository = repository or build_repository()
        self.simulator = ToolSimulator(self.repository, rates)
        self.generator = TaskGenerator(
            self.repository, no_tool_fraction, mcp_fraction, max_distractors, domains
        )
        self.user = user or ScriptedUserSimulator()
        self.partial_credit, self.max_turns, self.credit = partial_credit, max_turns, credit

    def reset(self, seed: int) -> Episode:
        task, world = self.generator.generate(seed)
        tools = [self.repository.spec(name) for name in task.agent.tool_names]
        messages = [
            {"role": "system", "content": task.agent.system_prompt},
            {"role": "user", "content": task.phases[0].request},
        ]
        state = {
            "world": world,
            "initial": copy.deepcopy(world),
            "task": task.to_dict(),
            "phase": 0,
            "phase_start": 1,
            "clarified": False,
            "calls": [],
        }
        return Episode(
            self.name,
            seed,
            task.task_id,
            messages,
            tools,
            state,
            task.max_turns if self.max_turns is None else min(task.max_turns, self.max_turns),
            needs_tools=task.needs_tools,
        )

    def step(self, episode: Episode, message: dict[str, Any]) -> None:
        if episode.done:
            return
        if not isinstance(message, dict):
            episode.messages.append({"role": "assistant", "content": str(message)})
            self._finish(episode, finished=False, reason="malformed message")
            return
        calls = message.get("tool_calls") or []
        clean = {"role": "assistant", "content": message.get("content")}
        if message.get("reasoning_content") is not None:
            clean["reasoning_content"] = message["reasoning_content"]
        if not isinstance(calls, list):
            episode.messages.append(clean)
            self._finish(episode, finished=False, reason="malformed tool call")
            return
        episode.turns += 1
        if calls:
            self._run_calls(episode, clean, calls)
            if episode.turns >= episode.max_turns:
                self._finish(episode, finished=False, reason="max turns")
            return
        episode.messages.append(clean)
        self._answer(episode, str(message.get("content") or ""))

    def _run_calls(self, episode: Episode, clean: dict[str, Any], calls: list[Any]) -> None:
        clean["tool_calls"] = []
        results = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            call_id = call.get("id") if isinstance(call, dict) else None
            call_id = (
                call_id
                if isinstance(call_id, str) and call_id
                else tool_call_id(str(name), episode.tool_calls)
            )
            index = episode.tool_calls
            episode.tool_calls += 1
            if not isinstance(name, str):
                observation = error_observation("malformed_call", "a tool call needs a function with a name")
            else:
                observation = self.simulator.execute(
                    episode.state["world"], name, arguments, episode.seed, index
                )
            clean["tool_calls"].append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": str(name), "arguments": _as_text(arguments)},
                }
            )
            results.append({"role": "tool", "tool_call_id": call_id, "content": observation.content})
            episode.state["calls"].append(self._log(name, arguments, observation.kind, observation.ok))
        episode.messages.append(clean)
        episode.messages.extend(results)

    def _log(self, name: Any, arguments: Any, kind: str, ok: bool) -> dict[str, Any]:
        """A call as the judge sees it: tool name, canonical arguments (when decodable), outcome kind."""
        tool: SyntheticTool | None = self.repository.synthetic.get(name) if isinstance(name, str) else None
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else dict(arguments or {})
        except (ValueError, TypeError):
            parsed = None
        canonical = tool.decode(parsed) if tool is not None and isinstance(parsed, dict) else parsed
        return {"tool": name, "args": canonical, "kind": kind, "ok": ok}

    def _answer(self, episode: Episode, text: str) -> None:
        task = Task.from_dict(episode.state["task"])
        state = episode.state
        if text.rstrip().endswith("?") and episode.turns < episode.max_turns:
            reply, state["clarified"] = self.user.reply(task, state["phase"], text, state["clarified"])
            episode.messages.append({"role": "user", "content": reply})
            return
        if episode.turns >= episode.max_turns and text.rstrip().endswith("?"):
            self._finish(episode, finished=False, reason="max turns")
            return
        state.setdefault("answers", []).append(text)
        if state["phase"] + 1 < len(task.phases) and episode.turns < episode.max_turns:
            state["phase"] += 1
            state["clarified"] = False
            episode.messages.append({"role": "user", "content": task.phases[state["phase"]].request})
            state["phase_start"] = len(episode.messages) - 1
            return
        self._finish(episode, finished=state["phase"] + 1 == len(task.phases), reason="answered")

    def _finish(self, episode: Episode, finished: bool, reason: str) -> None:
        verdict = judge_episode(episode, finished=finished)
        outcome = (
            "solved" if verdict.kept else (verdict.reasons[0].split(":")[0] if verdict.reasons else reason)
        )
        if self.credit == "progress":
            met = verdict.progress
        else:
            met = sum(bool(check.get("ok")) for check in verdict.checks) / max(1, len(verdict.checks))
        reward = 1.0 if verdict.kept else self.partial_credit * met
        episode.finish(
            verdict.kept,
            outcome,
            reward=reward,
            ended=reason,
            reasons=verdict.reasons,
            checks=verdict.checks,
            progress=round(verdict.progress, 6),
        )


#: The agentic-mini curriculum (``k2lab recipe agentic-mini``, ``mini-tools`` environments): canonical tool
#: names only (no evolved variants), at most one distractor per agent, at most 8 turns, and partial credit
#: for RL, so that a ~20M-parameter model can learn the tasks on a CPU.
MINI_TOOLS: dict[str, Any] = {
    "variants_per_tool": 0,
    "max_distractors": 1,
    "max_turns": 8,
    "partial_credit": 0.5,
}


def tool_env(name: str) -> ToolTaskEnvironment:
    """The environment named ``tools[:DOMAIN]`` (the full repository: 12 evolved variants of every base tool,
    up to 2 distractors) or ``mini-tools[:DOMAIN]`` (the ``MINI_TOOLS`` curriculum); ``DOMAIN`` restricts the
    tasks to one domain of ``k2lab.agentic.domains.DOMAINS`` (``retail``, ``calendar``, ``bank`` ...)."""
    kind, _, domain = name.partition(":")
    domains = [domain] if domain else None
    if kind in ("tools", "tool_tasks"):
        return ToolTaskEnvironment(domains=domains)
    if kind == "mini-tools":
        mini = MINI_TOOLS
        return ToolTaskEnvironment(
            build_repository(0, mini["variants_per_tool"]),
            max_distractors=mini["max_distractors"],
            partial_credit=mini["partial_credit"],
            domains=domains,
            max_turns=mini["max_turns"],
        )
    raise ValueError(f"unknown tool environment {name!r}: use tools[:DOMAIN] or mini-tools[:DOMAIN]")


def _as_text(arguments: Any) -> str:
    """Arguments as the JSON text the conversation records."""
    if isinstance(arguments, str):
        return arguments
    try:
        return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(str(arguments))
