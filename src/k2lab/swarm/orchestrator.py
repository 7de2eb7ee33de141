"""The swarm orchestrator: ``create_subagent`` / ``assign_task``, sub-agents in isolated contexts running
concurrently, and the episode's cost and latency accounting (the agent runtime itself is ``k2lab.runtime``).

``SwarmEnv`` is an ``Environment`` for the orchestrator (any ``Policy``: ``LocalPolicy``, ``EndpointPolicy``,
or a scripted / compact one). Per orchestrator turn t it handles the message's tool calls:

* ``create_subagent(name, system_prompt, tools)`` registers a sub-agent (its system prompt and the subset
  of worker tools it may call);
* ``assign_task(agent, task)`` runs that sub-agent on ``task`` from a fresh history
  ``[system(system_prompt), user(task)]`` — nothing of the orchestrator's or another sub-agent's context —
  with the frozen worker policy, for at most ``sub_max_steps`` steps. All assignments of one turn run at
  once in a ``ThreadPoolExecutor``; each final answer comes back as that call's tool observation
  ("NAME: s01=12; s04=7", or "NAME: unfinished after K steps");
* ``query_shard(shard, key)`` is answered directly (one per step, for the orchestrator and every
  sub-agent alike; further queries in the same message get an error observation).

A message without tool calls is the final answer (verified exactly, r_perf). An orchestrator still running
after ``max_turns`` turns ends with reason "budget". The latency measure (K2.5)::

    CriticalSteps = Σ_{t=1}^{T} ( S_main(t) + max_i S_sub,i(t) )

with S_main(t) = 1 (one orchestrator turn) and S_sub,i(t) the steps of sub-agent i launched at turn t
(0 when none). Cost: total tokens = tokens of every generated message, the orchestrator's and all
sub-agents' (counted by ``token_count``: a tokenizer's ids of the rendered message, or ⌈characters / 4⌉
without one), and total tool calls (orchestrator + sub-agents). Everything lives in ``episode.state``
(JSON-able) and ``swarm_metrics(episode)`` summarises it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from k2lab.agentic.episodes.env import Environment, Episode, tool_call_parts
from k2lab.agentic.episodes.rollout import Policy, PolicyOutputError
from k2lab.runtime.chat import ChatFormatError, normalize_messages, render_assistant_body
from k2lab.swarm.tasks import WideTask, make_task, parse_facts, verify_answer
from k2lab.train.persistence import derive_seed

__all__ = [
    "ORCHESTRATOR_TOOLS",
    "QUERY_TOOL",
    "ShardWorker",
    "SubAgentRun",
    "SwarmEnv",
    "critical_steps",
    "estimate_tokens",
    "swarm_metrics",
]

ToolHandler = Callable[[dict[str, Any]], str]


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


QUERY_TOOL = _tool(
    "query_shard",
    "The sales of product `key` in regional shard `shard` (one query per step).",
    {"shard": {"type": "string"}, "key": {"type": "string"}},
)
ORCHESTRATOR_TOOLS = [
    _tool(
        "create_subagent",
        "Create a sub-agent with its own system prompt and tools (a subset of: query_shard).",
        {
            "name": {"type": "string"},
            "system_prompt": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "string"}},
        },
    ),
    _tool(
        "assign_task",
        "Run sub-agent `agent` on `task`; its final answer is returned. Assignments in one message run "
        "concurrently.",
        {"agent": {"type": "string"}, "task": {"type": "string"}},
    ),
]


# ------------------------------------------------------------------------------------------ accounting


def critical_steps(stages: Sequence[Mapping[str, Any]]) -> int:
    """CriticalSteps = Σ_t (S_main(t) + max_i S_sub,i(t)); a stage is {"main": S_main, "subs": [S_sub,i]}."""
    return sum(int(stage["main"]) + max(stage["subs"], default=0) for stage in stages)


def estimate_tokens(message: Mapping[str, Any]) -> int:
    """⌈characters / 4⌉ of the message's content and tool calls (the count without a tokenizer)."""
    text = (message.get("content") or "") + json.dumps(message.get("tool_calls") or [])
    return math.ceil(len(text) / 4)


def tokenizer_counter(tokenizer: Any) -> Callable[[Mapping[str, Any]], int]:
    """A ``token_count`` that encodes the message as K2's chat format renders it (body + ``<|im_end|>``)."""

    def count(message: Mapping[str, Any]) -> int:
        try:
            body = render_assistant_body(normalize_messages([dict(message)])[0])
            return len(tokenizer.encode(body)) + 1
        except ChatFormatError:
            return estimate_tokens(message)

    return count


@dataclass
class SubAgentRun:
    """One sub-agent's run on one task: its own messages, steps, tokens, tool calls, answer and timing."""

    name: str
    task: str
    stage: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    tool_calls: int = 0
    finished: bool = False
    answer: str = ""
    error: str = ""
    started: float = 0.0
    ended: float = 0.0


def swarm_metrics(episode: Episode) -> dict[str, Any]:
    """CriticalSteps, total tokens / tool calls (orchestrator + sub-agents), sub-agents created and used
    (ran on at least one assigned task: ≥ 1 step), subtasks assigned / finished / unfinished of an episode
    played in ``SwarmEnv``. A last orchestrator turn that never reached the environment (truncated /
    malformed output: ``run_episode`` counts it in ``episode.turns`` without calling ``step``) is one more
    stage {"main": 1, "subs": []} of CriticalSteps, and its ids count as orchestrator tokens: the growth of
    ``episode.completion_tokens`` since the last ``step``."""
    state, runs = episode.state, episode.state.get("runs", [])
    finished = sum(1 for r in runs if r["finished"])
    failed_turn = max(0, episode.completion_tokens - state.get("completion_seen", 0))
    orchestrator = state.get("orchestrator_tokens", 0) + failed_turn
    stages = state.get("stages", [])
    unstepped = max(0, episode.turns - len(stages))  # S_main = 1 each, no sub-agent launched
    return {
        "critical_steps": critical_steps(stages) + unstepped,
        "total_tokens": orchestrator + sum(r["tokens"] for r in runs),
        "orchestrator_tokens": orchestrator,
        "tool_calls": episode.tool_calls + sum(r["tool_calls"] for r in runs),
        "subagents": len(state.get("subagents", {})),
        "subagents_used": len({r["name"] for r in runs if r["steps"] > 0}),
        "assigned": len(runs),
        "finished": finished,
        "unfinished": len(runs) - finished,
        "success": bool(episode.outcome and episode.outcome.success),
        "shards": len(state.get("task", {}).get("shards", [])),
    }


# ------------------------------------------------------------------------------------------ frozen worker


class ShardWorker:
    """A procedural frozen sub-agent (a ``Policy``): queries the shards named in its task one per step, then
    answers "s01=12; s04=7". The task must name ``key=P`` and ``shards=s01,s04`` (as the compact
    orchestrator writes them); anything else gets the answer "cannot parse task". ``delay_s`` sleeps per step
    (to observe concurrency)."""

    def __init__(self, delay_s: float = 0.0, token_count: Callable[[Mapping[str, Any]], int] | None = None):
        self.delay_s, self.count = delay_s, token_count or estimate_tokens

    def respond(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, seed: int = 0
    ) -> tuple[dict[str, Any], list[int]]:
        if self.delay_s:
            time.sleep(self.delay_s)
        task = next((m["content"] for m in messages if m["role"] == "user"), "")
        key, shards = _parse_assignment(task)
        facts = parse_facts(" ".join(m.get("content") or "" for m in messages if m["role"] == "tool"))
        todo = [s for s in shards if s not in facts]
        if key and todo:
            arguments = json.dumps({"shard": todo[0], "key": key})
            call = {"id": f"q{len(facts)}", "type": "function",
                    "function": {"name": "query_shard", "arguments": arguments}}  # fmt: skip
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif key:
            message = {"role": "assistant", "content": "; ".join(f"{s}={facts[s]}" for s in shards)}
        else:
            message = {"role": "assistant", "content": "cannot parse task"}
        return message, [0] * self.count(message)


def _parse_assignment(task: str) -> tuple[str, list[str]]:
    key = next((w[4:] for w in task.split() if w.startswith("key=")), "")
    shards = next((w[7:].strip(".").split(",") for w in task.split() if w.startswith("shards=")), [])
    return key, [s for s in shards if s]


# ------------------------------------------------------------------------------------------ environment


class SwarmEnv(Environment):
    """Wide tasks for an orchestrator with frozen sub-agents (``workers``); ``allow_subagents=False`` is the
    single-agent baseline (only ``query_shard``). See the module docstring for the protocol and metrics."""

    name = "wide-swarm"

    def __init__(
        self,
        workers: Policy | None = None,
        max_turns: int = 6,
        sub_max_steps: int = 4,
        min_shards: int = 3,
        max_shards: int = 16,
        allow_subagents: bool = True,
        max_workers: int = 16,
        token_count: Callable[[Mapping[str, Any]], int] | None = None,
    ) -> None:
        self.workers = workers or ShardWorker()
        self.max_turns, self.sub_max_steps = max_turns, sub_max_steps
        self.min_shards, self.max_shards = min_shards, max_shards
        self.allow_subagents, self.max_workers = allow_subagents, max_workers
        self.count = token_count or estimate_tokens
        self.tools = [QUERY_TOOL, *ORCHESTRATOR_TOOLS] if allow_subagents else [QUERY_TOOL]

    def task(self, episode: Episode) -> WideTask:
        data = episode.state["task"]
        return WideTask(data["seed"], data["product"], tuple(data["shards"]), data["databases"])

    def reset(self, seed: int) -> Episode:
        task = make_task(seed, self.min_shards, self.max_shards)
        system = "You are an orchestrator. Gather every fact, then answer with the total."
        state = {
            "task": {"seed": seed, "product": task.product, "shards": list(task.shards),
                     "databases": task.databases},
            "subagents": {}, "stages": [], "runs": [], "orchestrator_tokens": 0, "completion_seen": 0,
        }  # fmt: skip
        return Episode(
            env=self.name,
            seed=seed,
            task_id=f"wide-{seed}",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": task.question()}],
            tools=[dict(t) for t in self.tools],
            state=state,
            max_turns=self.max_turns,
        )

    def step(self, episode: Episode, message: dict[str, Any]) -> None:
        if episode.done:
            return
        episode.messages.append(dict(message))
        episode.turns += 1
        episode.state["orchestrator_tokens"] += self.count(message)
        episode.state["completion_seen"] = episode.completion_tokens
        calls = message.get("tool_calls") or []
        stage: dict[str, Any] = {"main": 1, "subs": []}
        episode.state["stages"].append(stage)
        if not calls:
            self._verify(episode, message.get("content") or "")
            return
        self._run_calls(episode, calls, stage)
        if not episode.done and episode.turns >= episode.max_turns:
            episode.finish(False, "budget", reward=0.0)

    def _verify(self, episode: Episode, answer: str) -> None:
        task = self.task(episode)
        if verify_answer(task, answer):
            episode.finish(True, "solved")
        else:
            episode.finish(False, "wrong answer", reward=0.0, expected=task.answer)

    def _run_calls(self, episode: Episode, calls: list[Any], stage: dict[str, Any]) -> None:
        """Observations in call order; the turn's assignments run concurrently."""
        observations: list[str | None] = []
        jobs: list[tuple[int, str, str]] = []
        queried = False
        for index, call in enumerate(calls):
            episode.tool_calls += 1
            name, arguments, problem = tool_call_parts(call)
            if problem:
                observations.append(f"error: {problem}")
            elif name == "assign_task" and self.allow_subagents:
                observations.append(None)
                jobs.append((index, str(arguments.get("agent", "")), str(arguments.get("task", ""))))
            elif name == "query_shard":
                observations.append(self._query(episode, arguments, queried))
                queried = True
            elif name == "create_subagent" and self.allow_subagents:
                observations.append(self._create(episode, arguments))
            else:
                observations.append(f"error: unknown tool {name!r}")
        runs = self.run_subagents(episode, jobs, len(episode.state["stages"]) - 1)
        for (index, _, _), run in zip(jobs, runs, strict=True):
            observations[index] = _observation(run)
            stage["subs"].append(run.steps)
        for call, text in zip(calls, observations, strict=True):
            call_id = call.get("id") if isinstance(call, Mapping) else None
            episode.messages.append({"role": "tool", "tool_call_id": call_id or "call", "content": text})

    def _query(self, episode: Episode, arguments: Mapping[str, Any], queried: bool) -> str:
        if queried:
            return "error: one query_shard per step"
        try:
            return self.task(episode).query(str(arguments.get("shard")), str(arguments.get("key")))
        except KeyError as error:
            return f"error: {error}"

    def _create(self, episode: Episode, arguments: Mapping[str, Any]) -> str:
        name, tools = str(arguments.get("name", "")).strip(), arguments.get("tools", [])
        if not name:
            return "error: a sub-agent needs a name"
        if not isinstance(tools, list) or any(t != "query_shard" for t in tools):
            return "error: tools must be a list drawn from ['query_shard']"
        if name in episode.state["subagents"]:
            return f"error: sub-agent {name!r} already exists"
        prompt = str(arguments.get("system_prompt", ""))
        episode.state["subagents"][name] = {"system_prompt": prompt, "tools": list(tools)}
        return f"created {name}"

    # ---- sub-agents
    def run_subagents(
        self, episode: Episode, jobs: list[tuple[int, str, str]], stage: int
    ) -> list[SubAgentRun]:
        """Run the assignments concurrently (a thread pool), each in its own context; results in job order."""
        if not jobs:
            return []
        specs = episode.state["subagents"]
        with ThreadPoolExecutor(min(self.max_workers, len(jobs))) as pool:
            futures = [
                pool.submit(self._run_one, episode, specs.get(agent), agent, task, stage, index)
                for index, agent, task in jobs
            ]
            runs = [future.result() for future in futures]
        episode.state["runs"] += [asdict(run) for run in runs]
        return runs

    def _run_one(
        self, episode: Episode, spec: Mapping[str, Any] | None, agent: str, task: str, stage: int, index: int
    ) -> SubAgentRun:
        run = SubAgentRun(agent, task, stage, started=time.perf_counter())
        if spec is None:
            run.error, run.ended = f"no sub-agent named {agent!r}", time.perf_counter()
            return run
        run.messages = [
            {"role": "system", "content": spec["system_prompt"]},
            {"role": "user", "content": task},
        ]
        tools = [QUERY_TOOL] if "query_shard" in spec["tools"] else []
        seed = derive_seed(episode.seed, "sub", stage, index)
        while run.steps < self.sub_max_steps and not run.finished and not run.error:
            self._sub_step(episode, run, tools, seed * 1000 + run.steps)
        run.ended = time.perf_counter()
        return run

    def _sub_step(self, episode: Episode, run: SubAgentRun, tools: list[dict[str, Any]], seed: int) -> None:
        run.steps += 1
        try:
            message, _ = self.workers.respond(list(run.messages), tools, seed=seed)
        except PolicyOutputError as error:
            run.error = error.reason
            return
        run.messages.append(dict(message))
        run.tokens += self.count(message)
        calls = message.get("tool_calls") or []
        if not calls:
            run.finished, run.answer = True, message.get("content") or ""
            return
        queried = False
        for call in calls:
            run.tool_calls += 1
            name, arguments, problem = tool_call_parts(call)
            allowed = name == "query_shard" and bool(tools)
            text = f"error: {problem}" if problem else (
                self._query(episode, arguments, queried) if allowed else f"error: unknown tool {name!r}"
            )  # fmt: skip
            queried = queried or allowed
            call_id = call.get("id") if isinstance(call, Mapping) else None
            run.messages.append({"role": "tool", "tool_call_id": call_id or "call", "content": text})


def _observation(run: SubAgentRun) -> str:
    if run.finished:
        return f"{run.name}: {run.answer}"
    return f"{run.name}: " + (f"error: {run.error}" if run.error else f"unfinished after {run.steps} steps")
