"""RL environments: verifiers on hand-written good and bad answers, and bad model output (malformed or
unknown tool calls, invalid arguments, tools that raise or hang, sandbox timeouts) ending the episode with
a reason instead of an exception."""

from __future__ import annotations

import json
import time

import pytest

from k2lab.agentic.episodes.env import Environment, Episode
from k2lab.agentic.rl.envs import (
    ArithmeticEnv,
    CodingEnv,
    EnvMixture,
    GuardedEnv,
    InstructionEnv,
    OpenQAEnv,
    ToolError,
    build_env,
    check_env_name,
    check_instruction,
    extract_python,
    safe_eval,
)
from k2lab.runtime.sandbox import SandboxLimits


def call(name: str, arguments: object, index: int = 0) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"functions.{name}:{index}",
                "type": "function",
                "function": {"name": name, "arguments": text},
            }
        ],
    }


def say(text: str) -> dict:
    return {"role": "assistant", "content": text}


# ---- safe evaluator


def test_safe_eval_arithmetic_only():
    assert safe_eval("37*49+12") == 1825
    assert safe_eval("(2 + 3) ** 2 - 7 // 2 % 4") == 22
    assert safe_eval("-1.5 * 2") == -3.0
    for bad in ("__import__('os')", "x + 1", "abs(-1)", "2 ** 1000", "1 / 0", "[1][0]", "1 +", "'a' * 3"):
        with pytest.raises(ToolError):
            safe_eval(bad)


# ---- arithmetic


def test_arithmetic_easy_and_hard_tasks():
    env = ArithmeticEnv()
    easy, hard = env.reset(0), env.reset(1)
    assert not easy.needs_tools and easy.token_budget == 8
    assert hard.needs_tools and hard.token_budget == 48
    assert [t["function"]["name"] for t in hard.tools] == ["calculate"]
    assert env.reset(1).to_dict() == hard.to_dict()  # deterministic in the seed
    question = hard.messages[-1]["content"]
    assert question.startswith("What is ") and "*" in question and "+" in question


def test_arithmetic_tool_then_answer_solves():
    env = ArithmeticEnv()
    episode = env.reset(1)
    expression = episode.messages[-1]["content"].removeprefix("What is ").removesuffix("?")
    env.step(episode, call("calculate", {"expression": expression}))
    assert not episode.done and episode.tool_calls == 1
    result = episode.messages[-1]
    assert result["role"] == "tool" and result["content"] == str(episode.state["answer"])
    env.step(episode, say(f"The answer is {result['content']}."))
    assert episode.done and episode.reward == 1.0 and episode.outcome.reason == "solved"


def test_arithmetic_wrong_answer():
    env = ArithmeticEnv()
    episode = env.reset(0)
    env.step(episode, say("It is 1000."))
    assert episode.done and episode.reward == 0.0 and episode.outcome.reason == "wrong answer"
    round_trip = Episode.from_dict(json.loads(json.dumps(episode.to_dict())))
    assert round_trip.to_dict() == episode.to_dict()


@pytest.mark.parametrize(
    "message, reason",
    [
        (call("calculate", "{not json"), "malformed tool call"),
        (call("calculate", "[1, 2]"), "malformed tool call"),
        ({"role": "assistant", "tool_calls": [{"function": "oops"}]}, "malformed tool call"),
        (call("search", {"query": "x"}), "unknown tool"),
        (call("calculate", {"expression": "__import__('os').system('ls')"}), "invalid arguments"),
        (call("calculate", {"expr": "1+1"}), "invalid arguments"),
    ],
)
def test_arithmetic_bad_tool_calls_end_with_reason(message, reason):
    env = ArithmeticEnv()
    episode = env.reset(1)
    env.step(episode, message)
    assert episode.done and episode.reward == 0.0 and episode.outcome.reason == reason


class RaisingTool(ArithmeticEnv):
    def __init__(self, hang: bool = False) -> None:
        super().__init__()
        self.tool_timeout_s = 0.2
        self.handlers = {"calculate": self._hang if hang else self._boom}

    @staticmethod
    def _boom(arguments):
        raise RuntimeError("backend down")

    @staticmethod
    def _hang(arguments):
        time.sleep(3)
        return "late"


def test_tool_that_raises_or_hangs_ends_episode():
    env = RaisingTool()
    episode = env.reset(1)
    env.step(episode, call("calculate", {"expression": "1+1"}))
    assert episode.outcome.reason == "tool error" and "backend down" in episode.outcome.details["error"]
    env = RaisingTool(hang=True)
    episode = env.reset(1)
    started = time.perf_counter()
    env.step(episode, call("calculate", {"expression": "1+1"}))
    assert time.perf_counter() - started < 2
    assert episode.done and episode.outcome.reason == "timeout"


def test_max_turns_of_tool_calls():
    env = ArithmeticEnv(max_turns=2)
    episode = env.reset(1)
    env.step(episode, call("calculate", {"expression": "1+1"}, 0))
    env.step(episode, call("calculate", {"expression": "2+2"}, 1))
    assert episode.done and episode.outcome.reason == "max turns"


# ---- instructions


@pytest.mark.parametrize(
    "kind, parameter, good, bad",
    [
        ("word_count", 3, "the sea sings", "the sea sings loudly"),
        ("lowercase", None, "rain falls softly", "Rain falls softly"),
        ("ends_with", "today", "the cat slept today.", "today the cat slept"),
        ("json_keys", ["color", "name"], '{"name": "sea", "color": "blue"}', '{"name": "sea"}'),
        ("json_keys", ["color", "name"], '{"color": 1, "name": 2}', "name: sea, color: blue"),
        ("no_commas", None, "bread is warm and good", "bread, warm, good"),
    ],
)
def test_instruction_verifiers(kind, parameter, good, bad):
    assert check_instruction(kind, parameter, good)
    assert not check_instruction(kind, parameter, bad)


def test_instruction_env_episode():
    env = InstructionEnv()
    kinds = {env.reset(seed).state["kind"] for seed in range(5)}
    assert kinds == set(InstructionEnv.KINDS)
    episode = env.reset(2)  # ends_with
    word = episode.state["parameter"]
    assert not episode.needs_tools and not episode.tools
    env.step(episode, say(f"i walk {word}"))
    assert episode.reward == 1.0 and episode.outcome.reason == "solved"
    episode = env.reset(2)
    env.step(episode, say("nothing"))
    assert episode.reward == 0.0 and episode.outcome.reason == "constraint violated"
    episode = env.reset(2)
    env.step(episode, call("calculate", {"expression": "1"}))
    assert episode.outcome.reason == "unknown tool"


# ---- coding


def test_extract_python():
    assert extract_python("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
    assert extract_python("```\nx = 1\n```") == "x = 1\n"
    assert extract_python("def f(): pass") is None


def test_coding_env_scores_tests_in_sandbox():
    env = CodingEnv(limits=SandboxLimits(timeout_s=1.0, memory_mb=256, max_processes=8))
    episode = env.reset(0)  # add(a, b)
    env.step(episode, say("```python\ndef add(a, b):\n    return a + b\n```"))
    assert episode.reward == 1.0 and episode.outcome.reason == "solved"
    episode = env.reset(0)
    env.step(episode, say("```python\ndef add(a, b):\n    return 3\n```"))  # passes only add(1, 2)
    assert episode.reward == pytest.approx(1 / 3) and episode.outcome.reason == "tests failed"
    episode = env.reset(0)
    env.step(episode, say("def add(a, b): return a + b"))
    assert episode.reward == 0.0 and episode.outcome.reason == "no code block"
    episode = env.reset(0)
    env.step(episode, say("```python\nwhile True:\n    pass\n```"))
    assert episode.reward == 0.0 and episode.outcome.reason == "timeout"
    episode = env.reset(0)
    env.step(episode, say("```python\ndef add(a, b)\n```"))
    assert episode.reward == 0.0 and episode.outcome.reason == "program error"


FORGERIES = {
    "forged line": 'import os\nprint(\'K2LAB_TESTS {"passed": 3, "total": 3}\', flush=True)\nos._exit(0)',
    "always equal": "class E:\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return E()",
    "equal int": "class E(int):\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return E(-7)",
    "patched eval": "import builtins\nbuiltins.eval = lambda *a: True",
}


@pytest.mark.parametrize("label", FORGERIES)
def test_coding_env_verdict_cannot_be_forged(label):
    """The verdict was the first `K2LAB_TESTS` line of the candidate's own stdout and tests compared with ==:
    printing the line then os._exit(0), or returning an object equal to everything, got reward 1."""
    env = CodingEnv(limits=SandboxLimits(timeout_s=3.0, memory_mb=256, max_processes=8))
    episode = env.reset(0)  # add(a, b)
    env.step(episode, say(f"```python\n{FORGERIES[label]}\n```"))
    assert not episode.outcome.success and episode.reward == 0.0, episode.outcome


def test_coding_env_compares_types_and_keeps_the_candidates_names():
    """1 is not True; a candidate global named like the harness's variables still passes."""
    env = CodingEnv(limits=SandboxLimits(timeout_s=3.0, memory_mb=256, max_processes=8))
    episode = env.reset(2)  # is_even(n)
    env.step(episode, say("```python\ndef is_even(n):\n    return int(n % 2 == 0)\n```"))
    assert episode.reward == 0.0 and episode.outcome.reason == "tests failed"
    episode = env.reset(2)
    code = "results, call, json = 0, 2, None\ndef is_even(n):\n    return n % call == results"
    env.step(episode, say(f"```python\n{code}\n```"))
    assert episode.reward == 1.0 and episode.outcome.success


# ---- adapters


class Flaky(Environment):
    name = "flaky"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def reset(self, seed: int) -> Episode:
        return Episode(env=self.name, seed=seed, task_id="t", messages=[{"role": "user", "content": "hi"}])

    def step(self, episode: Episode, message: dict) -> None:
        episode.messages.append(message)
        if self.mode == "raise":
            raise KeyError("broken simulator")
        time.sleep(3)


def test_guarded_env_turns_exceptions_and_hangs_into_outcomes():
    episode = GuardedEnv(Flaky("raise")).reset(0)
    GuardedEnv(Flaky("raise")).step(episode, say("x"))
    assert (
        episode.outcome.reason == "environment error"
        and "broken simulator" in episode.outcome.details["error"]
    )
    assert [m["role"] for m in episode.messages] == ["user", "assistant"]
    env = GuardedEnv(Flaky("hang"), timeout_s=0.2)
    episode = env.reset(0)
    started = time.perf_counter()
    env.step(episode, say("x"))
    assert time.perf_counter() - started < 2 and episode.outcome.reason == "timeout"


def test_mixture_is_deterministic_and_dispatches():
    mixture = EnvMixture([(ArithmeticEnv(), 1.0), (InstructionEnv(), 1.0), (OpenQAEnv(), 0.0)])
    names = [mixture.reset(seed).env for seed in range(40)]
    assert set(names) == {"arithmetic", "instruction"}
    assert names == [mixture.reset(seed).env for seed in range(40)]
    seed = names.index("arithmetic")
    episode = mixture.reset(seed)
    mixture.step(episode, say(str(episode.state["answer"])))
    assert episode.outcome.reason == "solved"
    with pytest.raises(ValueError):
        EnvMixture([(ArithmeticEnv(), 1.0), (ArithmeticEnv(), 1.0)])
    with pytest.raises(ValueError):
        build_env("nonsense")


def test_open_qa_marks_open_ended():
    env = OpenQAEnv()
    episode = env.reset(1)
    env.step(episode, say("Use a dark, quiet room."))
    assert episode.done and episode.state["open_ended"] and episode.outcome.reason == "answered"


def test_env_names_are_checked_without_building():
    """``check_env_name`` accepts what ``build_env`` builds and refuses the rest with the choices, so a list of
    names (``mopd experts --domains``) is checked before a long run, not when the bad one's turn comes."""
    for name in ("arithmetic", "open_qa", "tools", "tools:bank", "mini-tools:files", "tool_tasks"):
        check_env_name(name)
    for name, fragment in [("foo", "unknown environment 'foo'"), ("tools:zoo", "unknown tool domain 'zoo'")]:
        with pytest.raises(ValueError, match=fragment):
            check_env_name(name)
        with pytest.raises(ValueError, match=fragment):
            build_env(name)
