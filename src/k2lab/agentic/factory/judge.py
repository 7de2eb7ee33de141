"""The rubric judge: keeps only trajectories that satisfy their task's rubric, with reasons for the rest.

A rubric (``k2lab.agentic.factory.tasks``) has ``final_state`` checks, verified on the episode's world
(compared with its initial copy) and its call log (the domains' own check kinds,
``k2lab.agentic.domains.CHECKS``, plus the generic ``unchanged`` and ``called``), and trajectory ``items``,
verified on the messages. Every failed check yields one reason ``"<category>: <what is wrong>"``; categories:
``final_state``, ``unfinished``, ``confirmation``, ``unnecessary_question``, ``unnecessary_tool_call`` and
``tool_on_no_tool_task``.

The judge is rule-based (the world state makes tool tasks verifiable); an LLM judge for open-ended rubric
items could be added behind the same ``Verdict``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from k2lab.agentic.domains import CHECKS
from k2lab.agentic.domains.base import StateCheck
from k2lab.agentic.episodes.env import Episode

__all__ = ["CATEGORIES", "Verdict", "judge", "judge_episode", "reason_category", "solution_progress"]

CATEGORIES = (
    "final_state",
    "unfinished",
    "confirmation",
    "unnecessary_question",
    "unnecessary_tool_call",
    "tool_on_no_tool_task",
)


@dataclass
class Verdict:
    """``kept`` when every check passed; ``reasons`` for the failures; ``checks`` lists every check;
    ``progress`` how much of the reference solution the trajectory reproduced (``solution_progress``)."""

    kept: bool
    reasons: list[str] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    progress: float = 0.0


def reason_category(reason: str) -> str:
    """``final_state`` of ``"final_state: balance of b is 3.00, expected 5.00"``."""
    return reason.split(":", 1)[0]


def judge_episode(episode: Episode, finished: bool | None = None) -> Verdict:
    """Judge an episode of ``ToolTaskEnvironment`` (its ``state`` holds world, initial world, task, calls)."""
    state = episode.state
    if finished is None:
        finished = bool(episode.outcome and episode.outcome.details.get("ended") == "answered")
    return judge(
        state["task"]["rubric"], state["world"], state["initial"], state["calls"], episode.messages, finished
    )


def judge(
    rubric: dict[str, Any],
    world: dict[str, Any],
    initial: dict[str, Any],
    calls: list[dict[str, Any]],
    messages: list[dict[str, Any]],
    finished: bool,
) -> Verdict:
    """Check every final-state check and rubric item."""
    verdict = Verdict(kept=True)
    for check in rubric.get("final_state", []):
        problem = _state_problem(check, world, initial, calls)
        _record(verdict, check, "final_state", problem)
    for item in rubric.get("items", []):
        category, problem = _item_problem(item, messages, calls, finished)
        _record(verdict, item, category, problem)
    verdict.kept = not verdict.reasons
    verdict.progress = solution_progress(rubric, calls, messages)
    return verdict


def solution_progress(rubric: dict[str, Any], calls: list[dict[str, Any]], messages: list[dict]) -> float:
    """The share of the reference solution a trajectory reproduced, in [0, 1]: the mean of one score per
    planned call (each ``called`` check) and one for the final answers' key facts (``confirmed_result``):

        called:     1 if the planned call happened, else max over calls of that tool of  k / (n + 1)
                    (k of its n expected arguments equal; so a call with every value wrong scores 0)
        confirmed:  the fraction of the key terms that the final answers state (each answer its own terms)

    Unlike the fraction of rubric checks met, it gives nothing for what doing nothing satisfies ("nothing
    changed", "no unneeded tool", "no question"): a failed attempt ranks by how close it came. 0 when the
    rubric plans no call and names no terms."""
    scores = [
        _call_progress(check, calls) for check in rubric.get("final_state", []) if check["kind"] == "called"
    ]
    for item in rubric.get("items", []):
        if item["kind"] == "confirmed_result" and any(item["terms"]):
            scores.append(_terms_stated(item["terms"], _final_answers(messages)))
    return sum(scores) / len(scores) if scores else 0.0


def _call_progress(check: dict[str, Any], calls: list[dict[str, Any]]) -> float:
    if _called(check, {}, {}, calls) is None:
        return 1.0
    wanted = _canonical(check.get("args") or {})
    best = 0
    for call in calls:
        if call["tool"] != check["tool"] or not isinstance(call.get("args"), dict):
            continue
        given = _canonical(call["args"])
        best = max(best, sum(key in given and given[key] == value for key, value in wanted.items()))
    return best / (len(wanted) + 1)


def _terms_stated(terms: list[list[str]], answers: list[str]) -> float:
    stated = sum(
        term.lower() in answer.lower()
        for wanted, answer in zip(terms, answers, strict=False)
        for term in wanted
    )
    return stated / sum(len(wanted) for wanted in terms)


def _record(verdict: Verdict, check: dict[str, Any], category: str, problem: str | None) -> None:
    verdict.checks.append(
        {"kind": check["kind"], "description": check.get("description", ""), "ok": not problem}
    )
    if problem:
        verdict.reasons.append(f"{category}: {problem}")


# ------------------------------------------------------------------------------------------ final state


def _state_problem(check: dict[str, Any], world: dict, initial: dict, calls: list[dict]) -> str | None:
    handler = STATE_CHECKS.get(check["kind"])
    if handler is None:
        return f"unknown check kind {check['kind']!r}"
    try:
        return handler(check, world, initial, calls)
    except (KeyError, TypeError, ValueError) as error:
        return f"{check['kind']} could not be checked ({type(error).__name__}: {error})"


def _unchanged(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    section = check.get("section")
    before, after = (initial, world) if section is None else (initial[section], world[section])
    if _canonical(before) != _canonical(after):
        return f"{section or 'the world'} changed although nothing should have"
    return None


def _called(check: dict, world: dict, initial: dict, calls: list) -> str | None:
    wanted = _canonical(check.get("args") or {})
    for call in calls:
        if call["tool"] != check["tool"] or _canonical(call.get("args") or {}) != wanted:
            continue
        if (check["outcome"] == "ok" and call["ok"]) or call["kind"] == check["outcome"]:
            return None
    return f"no {check['outcome']} call of {check['tool']} with {json.dumps(check.get('args') or {})}"


def _canonical(value: Any) -> Any:
    """Numbers rounded to 6 decimals (ints and floats alike), containers recursively."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return round(float(value), 6)
    if isinstance(value, dict):
        return {key: _canonical(sub) for key, sub in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(sub) for sub in value]
    return value


#: Final-state check kind -> verifier: the domains' own kinds and the generic ``unchanged`` and ``called``.
STATE_CHECKS: dict[str, StateCheck] = {**CHECKS, "unchanged": _unchanged, "called": _called}


# ------------------------------------------------------------------------------------------ trajectory


def _final_answers(messages: list[dict[str, Any]]) -> list[str]:
    """The text of every assistant turn that answered (no tool calls, not a question)."""
    return [
        str(m.get("content") or "")
        for m in messages
        if m.get("role") == "assistant" and not m.get("tool_calls") and not _is_question(m)
    ]


def _is_question(message: dict[str, Any]) -> bool:
    return str(message.get("content") or "").rstrip().endswith("?")


def _item_problem(
    item: dict, messages: list[dict], calls: list[dict], finished: bool
) -> tuple[str, str | None]:
    kind = item["kind"]
    if kind == "finished":
        return "unfinished", None if finished else "the episode ended without a final answer (turn limit)"
    if kind == "confirmed_result":
        return "confirmation", _confirmation_problem(item["terms"], _final_answers(messages))
    if kind == "no_unnecessary_questions":
        asked = sum(
            1
            for m in messages
            if m.get("role") == "assistant" and not m.get("tool_calls") and _is_question(m)
        )
        too_many = asked > item["max_questions"]
        return (
            "unnecessary_question",
            f"asked {asked} question(s), {item['max_questions']} needed" if too_many else None,
        )
    if kind == "only_needed_tools":
        extra = sorted({str(c["tool"]) for c in calls} - set(item["allowed"]))
        return "unnecessary_tool_call", f"called {', '.join(extra)}" if extra else None
    if kind == "no_tool_calls":
        return "tool_on_no_tool_task", f"made {len(calls)} tool call(s)" if calls else None
    return "final_state", f"unknown rubric item {kind!r}"


def _confirmation_problem(terms: list[list[str]], answers: list[str]) -> str | None:
    if len(answers) < len(terms):
        return f"{len(answers)} final answer(s) for {len(terms)} request(s)"
    for index, (wanted, answer) in enumerate(zip(terms, answers, strict=False)):
        missing = [term for term in wanted if term.lower() not in answer.lower()]
        if missing:
            return f"answer {index + 1} does not state {', '.join(map(repr, missing))}"
    return None
