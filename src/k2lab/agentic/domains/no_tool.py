"""The no-tool drafts: small talk and questions an agent of any domain answers directly, without a tool.

``TaskGenerator`` draws one for a share of the tasks (``no_tool_fraction``); its rubric asks for no tool
call and a final answer stating ``term``.
"""

from __future__ import annotations

import random
from typing import Any

from k2lab.agentic.domains.base import Draft, Phase

__all__ = ["NO_TOOL_TASKS", "no_tool_task"]

#: ``(request, expected answer, the key term the answer must state)``.
NO_TOOL_TASKS: tuple[tuple[str, str, str], ...] = (
    (
        "Hi there! How's your day going?",
        "Hi! Doing well, thanks for asking. I'm here whenever you need help.",
        "thanks",
    ),
    ("What is the capital of France?", "The capital of France is Paris.", "Paris"),
    ("How many days are in a week?", "A week has 7 days.", "7"),
    ("What is 2 + 2?", "2 + 2 is 4.", "4"),
    ("How many minutes are in an hour?", "An hour has 60 minutes.", "60"),
    ("Thanks, that's all for today!", "You're welcome, have a great day!", "welcome"),
    ("Spell the word 'cat' backwards.", "Backwards, 'cat' is 'tac'.", "tac"),
    (
        "At what temperature in Celsius does water boil at sea level?",
        "Water boils at 100 degrees Celsius.",
        "100",
    ),
)


def no_tool_task(rng: random.Random, world: dict[str, Any]) -> Draft:
    """One of ``NO_TOOL_TASKS``; nothing in the world may change."""
    request, answer, term = NO_TOOL_TASKS[rng.randrange(len(NO_TOOL_TASKS))]
    phase = Phase(request, [], answer, terms=[term])
    return Draft("no_tool", [phase], [{"kind": "unchanged", "description": "nothing changed"}])
