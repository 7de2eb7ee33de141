"""RL environments with programmatic verifiers (K2's RL Gym at toy scale) and their weighted mixture.

Every environment is deterministic in its seed and never raises on bad model output: a malformed tool
call, an unknown tool, invalid arguments, a tool that raises, a tool or sandbox that runs out of time all
end the episode with ``outcome.reason`` saying why (reward 0).

* ``ArithmeticEnv``   "What is 37*49+12?" with a ``calculate(expression)`` tool (an AST evaluator, never
                      ``eval``); reward 1 when the final answer contains the right number. Even seeds are
                      trivial ("What is 2+3?", ``needs_tools=False``, small ``token_budget``), odd seeds hard.
* ``InstructionEnv``  format constraints checked by code (exact word count, lowercase, last word, JSON keys,
                      no commas), ``needs_tools=False``.
* ``CodingEnv``       small Python functions; reward = fraction of unit tests passed (values returned in the
                      sandbox, compared outside it).
* ``OpenQAEnv``       open-ended prompts with no verifier (``state["open_ended"]``): the RL loop rewards
                      them with the self-critique rubric critic (``k2lab.agentic.rl.critic``).
* ``GuardedEnv``      wraps any ``Environment`` (e.g. the factory's tool tasks): exceptions and hangs in
                      ``step`` end the episode ("environment error" / "timeout") instead of the run.
* ``EnvMixture``      a weighted mixture; ``reset(seed)`` picks a member from the seed.
"""

from __future__ import annotations

import ast
import copy
import json
import operator
import random
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k2lab.agentic.domains import DOMAINS
from k2lab.agentic.episodes.env import Environment, Episode, tool_call_parts
from k2lab.agentic.factory.tasks import tool_env
from k2lab.runtime.sandbox import SandboxLimits, run_python

__all__ = [
    "ArithmeticEnv",
    "CodingEnv",
    "EnvMixture",
    "GuardedEnv",
    "InstructionEnv",
    "OpenQAEnv",
    "ToolError",
    "build_env",
    "check_env_name",
    "extract_python",
    "run_tool_calls",
    "safe_eval",
]

# ------------------------------------------------------------------------------------------ safe evaluator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30


class ToolError(Exception):
    """A tool refused its input (the message becomes the tool's error observation / outcome detail)."""


def safe_eval(expression: str) -> int | float:
    """Evaluate + - * / // % ** and parentheses over int/float literals, by walking the AST.

    Raises ``ToolError`` for anything else (names, calls, attributes ...), exponents above 100, results
    above 10^30 in magnitude and division by zero. Never calls ``eval``.
    """
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression must be a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ToolError(f"cannot parse {expression!r}: {error.msg}") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ToolError("exponent too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ToolError("result out of range")
        return value
    raise ToolError(f"unsupported syntax: {type(node).__name__}")


def format_number(value: int | float) -> str:
    """Integers (and integral floats) without a decimal point, other floats rounded to 6 digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


# ------------------------------------------------------------------------------------------ tool calling

ToolHandler = Callable[[dict[str, Any]], str]


def run_tool_calls(
    episode: Episode, message: Mapping[str, Any], handlers: Mapping[str, ToolHandler], timeout_s: float = 5.0
) -> bool:
    """Run the message's tool calls, appending ``role: tool`` results; False when one ended the episode.

    Ends the episode (reward 0) with reason "malformed tool call" (not a ``{function: {name, arguments}}``
    object or arguments that are not a JSON object), "unknown tool", "invalid arguments" (the handler
    raised ``ToolError`` or ``TypeError``/``KeyError`` on the arguments), "tool error" (any other
    exception) or "timeout" (the handler ran past ``timeout_s``; it is abandoned in a daemon thread).
    """
    for call in message.get("tool_calls") or []:
        episode.tool_calls += 1
        name, arguments, problem = tool_call_parts(call)
        if problem:
            episode.finish(False, "malformed tool call", reward=0.0, problem=problem)
            return False
        if name not in handlers:
            episode.finish(False, "unknown tool", reward=0.0, tool=name)
            return False
        status, result = call_with_deadline(lambda h=handlers[name], a=arguments: h(a), timeout_s)
        if status != "ok":
            episode.finish(False, status, reward=0.0, tool=name, error=str(result))
            return False
        episode.messages.append({"role": "tool", "tool_call_id": call.get("id") or name, "content": result})
    return True


def call_with_deadline(function: Callable[[], Any], timeout_s: float) -> tuple[str, Any]:
    """``("ok", value)``, ``("invalid arguments" | "tool error", exception)`` or ``("timeout", message)``.

    The call runs in a daemon thread; one still running at the deadline is abandoned (it cannot be killed,
    but it no longer blocks anything and does not keep the process alive).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = function()
        except BaseException as error:  # noqa: BLE001 - a tool's failure is an observation, not a crash
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return "timeout", f"no result after {timeout_s:g} s"
    if "error" in box:
        error = box["error"]
        kind = "invalid arguments" if isinstance(error, ToolError | TypeError | KeyError) else "tool error"
        return kind, f"{type(error).__name__}: {error}"
    return "ok", box["value"]


def _function_tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }


def _final_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


class _SingleAnswerEnv(Environment):
    """Shared ``step``: run tool calls (``handlers``) until a message without calls, then ``verify`` it."""

    handlers: dict[str, ToolHandler] = {}
    tool_timeout_s: float = 5.0

    def step(self, episode: Episode, message: dict[str, Any]) -> None:
        if episode.done:
            return
        episode.messages.append(dict(message))
        episode.turns += 1
        if message.get("tool_calls"):
            if run_tool_calls(episode, message, self.handlers, self.tool_timeout_s) and (
                episode.turns >= episode.max_turns
            ):
                episode.finish(False, "max turns", reward=0.0)
            return
        self.verify(episode, _final_text(message))

    def verify(self, episode: Episode, answer: str) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ arithmetic


class ArithmeticEnv(_SingleAnswerEnv):
    """Arithmetic questions with a ``calculate`` tool; reward 1 iff the final answer contains the number.

    Even seeds: "What is a+b?" with one-digit a, b (``needs_tools=False``, ``token_budget=easy_budget``).
    Odd seeds: "What is a*b+c?" with two-digit numbers (``needs_tools=True``, ``token_budget=hard_budget``).
    """

    name = "arithmetic"

    def __init__(self, easy_budget: int = 8, hard_budget: int = 48, max_turns: int = 4) -> None:
        self.easy_budget, self.hard_budget, self.max_turns = easy_budget, hard_budget, max_turns
        self.tools = [
            _function_tool(
                "calculate",
                "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
                {"expression": {"type": "string"}},
            )
        ]
        self.handlers = {"calculate": self._calculate}

    @staticmethod
    def _calculate(arguments: dict[str, Any]) -> str:
        return format_number(safe_eval(arguments["expression"]))

    def reset(self, seed: int) -> Episode:
        rng = random.Random(seed)
        easy = seed % 2 == 0
        if easy:
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            question, answer = f"{a}+{b}", a + b
        else:
            a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(1, 99)
            question, answer = f"{a}*{b}+{c}", a * b + c
        return Episode(
            env=self.name,
            seed=seed,
            task_id=f"arithmetic-{seed}",
            messages=[
                {"role": "system", "content": "Answer with the number."},
                {"role": "user", "content": f"What is {question}?"},
            ],
            tools=copy.deepcopy(self.tools),
            state={"answer": answer},
            max_turns=self.max_turns,
            token_budget=self.easy_budget if easy else self.hard_budget,
            needs_tools=not easy,
        )

    def verify(self, episode: Episode, answer: str) -> None:
        numbers = re.findall(r"-?\d+", answer.replace(",", ""))
        if str(episode.state["answer"]) in numbers:
            episode.finish(True, "solved")
        else:
            episode.finish(False, "wrong answer", reward=0.0, expected=episode.state["answer"])


# ------------------------------------------------------------------------------------------ instructions

_TOPICS = ("the sea", "a cat", "the moon", "bread", "rain", "a city", "music", "a tree")
_ENDINGS = ("today", "again", "slowly", "home", "now")


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


def check_instruction(kind: str, parameter: Any, text: str) -> bool:
    """Whether ``text`` satisfies the constraint ``kind`` (with its ``parameter``)."""
    text = text.strip()
    if kind == "word_count":
        return len(text.split()) == parameter
    if kind == "lowercase":
        return bool(text) and text == text.lower() and any(c.isalpha() for c in text)
    if kind == "ends_with":
        words = _words(text)
        return bool(words) and words[-1].lower() == parameter
    if kind == "json_keys":
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return False
        return isinstance(value, dict) and sorted(value) == sorted(parameter)
    if kind == "no_commas":
        return bool(text) and "," not in text
    raise ValueError(f"unknown instruction kind {kind!r}")


class InstructionEnv(_SingleAnswerEnv):
    """Write about a topic under one format constraint, verified by ``check_instruction``; no tools."""

    name = "instruction"
    KINDS = ("word_count", "lowercase", "ends_with", "json_keys", "no_commas")

    def __init__(self, token_budget: int = 32) -> None:
        self.token_budget = token_budget

    def reset(self, seed: int) -> Episode:
        rng = random.Random(seed)
        topic, kind = rng.choice(_TOPICS), self.KINDS[seed % len(self.KINDS)]
        parameter: Any = None
        if kind == "word_count":
            parameter = rng.randint(2, 6)
            instruction = f"Write exactly {parameter} words about {topic}."
        elif kind == "lowercase":
            instruction = f"Write a sentence about {topic} in all lowercase letters."
        elif kind == "ends_with":
            parameter = rng.choice(_ENDINGS)
            instruction = f"Write a sentence about {topic} that ends with the word '{parameter}'."
        elif kind == "json_keys":
            parameter = sorted(rng.sample(["name", "color", "size", "age"], 2))
            instruction = f"Describe {topic} as a JSON object with exactly the keys {', '.join(parameter)}."
        else:
            instruction = f"Write a sentence about {topic} without any commas."
        return Episode(
            env=self.name,
            seed=seed,
            task_id=f"instruction-{kind}-{seed}",
            messages=[{"role": "user", "content": instruction}],
            state={"kind": kind, "parameter": parameter},
            max_turns=1,
            token_budget=self.token_budget,
            needs_tools=False,
        )

    def verify(self, episode: Episode, answer: str) -> None:
        ok = check_instruction(episode.state["kind"], episode.state["parameter"], answer)
        episode.finish(ok, "solved" if ok else "constraint violated", reward=float(ok))


# ------------------------------------------------------------------------------------------ coding

CODING_TASKS: tuple[dict[str, Any], ...] = (
    {
        "name": "add",
        "prompt": "Write a Python function add(a, b) that returns the sum of a and b.",
        "tests": [["add(1, 2)", 3], ["add(-1, 1)", 0], ["add(10, 5)", 15]],
    },
    {
        "name": "reverse",
        "prompt": "Write a Python function reverse(s) that returns the string s reversed.",
        "tests": [["reverse('abc')", "cba"], ["reverse('')", ""], ["reverse('ab')", "ba"]],
    },
    {
        "name": "is_even",
        "prompt": "Write a Python function is_even(n) that returns True when n is even.",
        "tests": [["is_even(2)", True], ["is_even(3)", False], ["is_even(0)", True]],
    },
    {
        "name": "largest",
        "prompt": "Write a Python function largest(xs) that returns the largest number in the list xs.",
        "tests": [["largest([1, 3, 2])", 3], ["largest([-5, -2])", -2], ["largest([7])", 7]],
    },
)
RESULTS_MARKER = "K2LAB_RESULTS "
# Runs after the candidate's code, in its process: it only reports what each call returned (JSON, or null
# when the call raised or its value is not JSON). The expected values never enter the sandbox.
_HARNESS = """
import json as _k2lab_json
_k2lab_results = []
for _k2lab_call in {calls!r}:
    try:
        _k2lab_results.append([_k2lab_json.dumps(eval(_k2lab_call))])
    except BaseException:
        _k2lab_results.append(None)
print({marker!r} + _k2lab_json.dumps(_k2lab_results), flush=True)
"""


_MISSING = object()  # a call that raised or returned a non-JSON value: equal to no expected value


def same_value(got: Any, expected: Any) -> bool:
    """``got == expected`` with the same type at every level (``True`` is not ``1``, ``3.0`` is not ``3``)."""
    if type(got) is not type(expected):
        return False
    if isinstance(expected, list):
        return len(got) == len(expected) and all(map(same_value, got, expected))
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(same_value(got[k], expected[k]) for k in expected)
    return got == expected


def score_results(line: str, tests: Sequence[Sequence[Any]]) -> int:
    """How many of ``tests`` (``[call, expected]``) a harness results line passes; a malformed line
    (written by the candidate instead of the harness) passes none."""
    try:
        results = json.loads(line[len(RESULTS_MARKER) :])
        values = [json.loads(entry[0]) if entry else _MISSING for entry in results]
    except (ValueError, TypeError, IndexError, KeyError, RecursionError):
        return 0
    if len(values) != len(tests):
        return 0
    return sum(same_value(value, expected) for value, (_, expected) in zip(values, tests, strict=True))


def extract_python(text: str) -> str | None:
    """The code of the first ```python (or bare ```) block in ``text``; None when there is none."""
    match = re.search(r"```(?:python|py)?[ \t]*\n(.*?)```", text, re.DOTALL)
    return match.group(1) if match else None


class CodingEnv(_SingleAnswerEnv):
    """Implement a small function; the answer's ```python block runs in the sandbox against unit tests.

    reward = passed / total; a sandbox timeout, crash of the whole program or a missing code block give 0
    with reasons "timeout", "program error" and "no code block".

    The verdict is not the candidate's to write: the sandbox only reports what each test call returned (the
    last ``K2LAB_RESULTS`` line) and the expected values, which never enter the sandbox, are compared here
    type-strictly (``same_value``). A forged line or an object whose ``__eq__`` is always true scores only
    what it would score by returning the right values.
    """

    name = "coding"

    def __init__(self, limits: SandboxLimits | None = None, token_budget: int = 64) -> None:
        self.limits = limits or SandboxLimits(timeout_s=3.0, memory_mb=256, max_processes=8)
        self.token_budget = token_budget

    def reset(self, seed: int) -> Episode:
        task = CODING_TASKS[seed % len(CODING_TASKS)]
        return Episode(
            env=self.name,
            seed=seed,
            task_id=f"coding-{task['name']}",
            messages=[{"role": "user", "content": task["prompt"] + " Answer with a ```python code block."}],
            state={"tests": list(task["tests"])},
            max_turns=1,
            token_budget=self.token_budget,
            needs_tools=False,
        )

    def verify(self, episode: Episode, answer: str) -> None:
        code = extract_python(answer)
        if code is None:
            episode.finish(False, "no code block", reward=0.0)
            return
        tests = episode.state["tests"]
        calls = [call for call, _ in tests]
        result = run_python(code + "\n" + _HARNESS.format(calls=calls, marker=RESULTS_MARKER), self.limits)
        if result.timed_out or result.killed_reason:
            episode.finish(False, "timeout", reward=0.0, killed=result.killed_reason)
            return
        lines = [x for x in result.stdout.splitlines() if x.startswith(RESULTS_MARKER)]
        if not lines:
            episode.finish(False, "program error", reward=0.0, stderr=result.stderr[-500:])
            return
        passed = score_results(lines[-1], tests)
        reward = passed / len(tests)
        solved = passed == len(tests)
        reason = "solved" if solved else "tests failed"
        episode.finish(solved, reason, reward=reward, passed=passed, total=len(tests))


# ------------------------------------------------------------------------------------------ open-ended

_OPEN_PROMPTS = (
    "Describe the sea in one sentence.",
    "Give one tip for sleeping well.",
    "Say something kind to a friend.",
    "Explain why the sky is blue, briefly.",
)


class OpenQAEnv(_SingleAnswerEnv):
    """Open-ended prompts without a verifier: the episode ends after one answer with reward 0 and
    ``state["open_ended"] = True``; the RL loop replaces the reward with the rubric critic's win rate."""

    name = "open_qa"

    def __init__(self, token_budget: int = 32) -> None:
        self.token_budget = token_budget

    def reset(self, seed: int) -> Episode:
        prompt = _OPEN_PROMPTS[seed % len(_OPEN_PROMPTS)]
        return Episode(
            env=self.name,
            seed=seed,
            task_id=f"open_qa-{seed % len(_OPEN_PROMPTS)}",
            messages=[{"role": "user", "content": prompt}],
            state={"open_ended": True},
            max_turns=1,
            token_budget=self.token_budget,
            needs_tools=False,
        )

    def verify(self, episode: Episode, answer: str) -> None:
        episode.finish(bool(answer.strip()), "answered" if answer.strip() else "empty answer", reward=0.0)


# ------------------------------------------------------------------------------------------ adapters


class GuardedEnv(Environment):
    """Any ``Environment`` with a deadline and an exception guard around ``step``.

    ``step`` runs on a deep copy of the episode in a daemon thread; the copy replaces the episode's
    fields when it returns in time. An exception ends the episode with "environment error", a step past
    ``timeout_s`` with "timeout" (the hung thread is abandoned and its copy discarded).
    """

    def __init__(self, env: Environment, timeout_s: float = 30.0, name: str | None = None) -> None:
        self.env, self.timeout_s = env, timeout_s
        self.name = name or env.name

    def reset(self, seed: int) -> Episode:
        episode = self.env.reset(seed)
        episode.env = self.name
        return episode

    def step(self, episode: Episode, message: dict[str, Any]) -> None:
        if episode.done:
            return
        work = copy.deepcopy(episode)
        status, result = call_with_deadline(lambda: self.env.step(work, message), self.timeout_s)
        if status == "ok":
            episode.__dict__.update(work.__dict__)
            return
        episode.messages.append(dict(message))
        episode.turns += 1
        reason = "timeout" if status == "timeout" else "environment error"
        episode.finish(False, reason, reward=0.0, error=str(result))


class EnvMixture(Environment):
    """A weighted mixture of environments; ``reset(seed)`` draws the member from ``random.Random(seed)``.

    Every member is wrapped in ``GuardedEnv``; episodes carry the member's name in ``episode.env`` so
    ``step`` dispatches to it. Member names must be unique.
    """

    name = "mixture"

    def __init__(
        self,
        members: Sequence[tuple[Environment, float]] | Mapping[str, Environment],
        timeout_s: float = 30.0,
    ) -> None:
        pairs = [(env, 1.0) for env in members.values()] if isinstance(members, Mapping) else list(members)
        if not pairs or any(weight < 0 for _, weight in pairs) or sum(w for _, w in pairs) <= 0:
            raise ValueError("a mixture needs at least one environment and non-negative weights summing > 0")
        self.members = [GuardedEnv(env, timeout_s) for env, _ in pairs]
        self.weights = [float(weight) for _, weight in pairs]
        self.by_name = {env.name: env for env in self.members}
        if len(self.by_name) != len(self.members):
            raise ValueError(f"environment names must be unique: {[e.name for e in self.members]}")

    def pick(self, seed: int) -> GuardedEnv:
        return random.Random(seed).choices(self.members, weights=self.weights)[0]

    def reset(self, seed: int) -> Episode:
        return self.pick(seed).reset(seed)

    def step(self, episode: Episode, message: dict[str, Any]) -> None:
        env = self.by_name.get(episode.env)
        if env is None:
            episode.finish(False, "environment error", reward=0.0, error=f"no environment {episode.env!r}")
            return
        env.step(episode, message)


ENVIRONMENTS: dict[str, Callable[[], Environment]] = {
    "arithmetic": ArithmeticEnv,
    "instruction": InstructionEnv,
    "coding": CodingEnv,
    "open_qa": OpenQAEnv,
}


TOOL_ENVIRONMENTS = ("tools", "tool_tasks", "mini-tools")  # ``KIND[:DOMAIN]``: the factory's tool tasks


def check_env_name(name: str) -> None:
    """Raise ``ValueError`` (listing the choices) unless ``build_env`` knows ``name``; builds nothing, so a
    list of names can be checked before a long run."""
    kind, _, domain = name.partition(":")
    if name in ENVIRONMENTS or (kind in TOOL_ENVIRONMENTS and (not domain or domain in DOMAINS)):
        return
    if kind in TOOL_ENVIRONMENTS:
        raise ValueError(
            f"unknown tool domain {domain!r} in {name!r}; choose from {', '.join(sorted(DOMAINS))}"
        )
    choices = ", ".join([*ENVIRONMENTS, "tools[:DOMAIN]", "mini-tools[:DOMAIN]"])
    raise ValueError(f"unknown environment {name!r}; choose from {choices}")


def build_env(name: str) -> Environment:
    """An environment by name: arithmetic, instruction, coding, open_qa, or the factory's tool tasks
    ``tools[:DOMAIN]`` / ``mini-tools[:DOMAIN]`` (``k2lab.agentic.factory.tasks.tool_env``)."""
    check_env_name(name)
    return ENVIRONMENTS[name]() if name in ENVIRONMENTS else tool_env(name)
