"""The vocabulary a tool domain is written in: tool and task data types, the ``Domain`` record, and what
several domains share (days of the week, quantities, money rounding, JSON-schema snippets).

Nothing here knows a particular domain; ``k2lab.agentic.domains`` lists the domains, and the machinery that
uses them lives in ``k2lab.agentic.factory.tools`` (evolution, repository), ``k2lab.agentic.factory.tasks``
(agents, task generation, the environment) and ``k2lab.agentic.factory.judge`` (the rubric judge).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from k2lab.errors import K2LabError

__all__ = [
    "DAY",
    "DAYS",
    "FULL_DAYS",
    "IDENTITY",
    "OPTIONAL_DAY",
    "QTY",
    "BaseTool",
    "Clarification",
    "Codec",
    "CodecOption",
    "Domain",
    "Draft",
    "Param",
    "Phase",
    "StateCheck",
    "Step",
    "Template",
    "ToolError",
    "clarify",
    "day_codecs",
    "day_name",
    "integer",
    "money",
    "string",
]

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
FULL_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


class ToolError(K2LabError):
    """A domain error of a tool call (``kind``: ``unknown_item``, ``insufficient_funds``, ...)."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


# ------------------------------------------------------------------------------------------------ tools


@dataclass(frozen=True)
class Codec:
    """How a variant writes one canonical value: ``identity``, ``scale`` (exposed = canonical * factor,
    e.g. cents) or ``enum`` (a mapping of canonical values to exposed ones)."""

    kind: str = "identity"
    factor: float = 1.0
    mapping: tuple[tuple[Any, Any], ...] = ()
    schema: tuple[tuple[str, Any], ...] = ()  # overrides of the parameter's JSON schema
    note: str = ""

    def encode(self, value: Any) -> Any:
        """The exposed value of a canonical one."""
        if self.kind == "scale" and isinstance(value, int | float):
            scaled = value * self.factor
            return int(round(scaled)) if dict(self.schema).get("type") == "integer" else scaled
        if self.kind == "enum":
            return dict(self.mapping).get(value, value)
        return value

    def decode(self, value: Any) -> Any:
        """The canonical value of an exposed one."""
        if self.kind == "scale" and isinstance(value, int | float) and not isinstance(value, bool):
            return round(value / self.factor, 6)
        if self.kind == "enum":
            return {exposed: canonical for canonical, exposed in self.mapping}.get(value, value)
        return value


IDENTITY = Codec()

#: A codec evolution may pick for a parameter, with parameter names that fit it (empty: keep the canonical
#: name and its synonyms).
CodecOption = tuple[Codec, tuple[str, ...]]


@dataclass(frozen=True)
class Param:
    """A canonical parameter: its JSON schema, whether it is required, its ``kind`` (which decides the
    unit / enum variants evolution may choose: ``plain`` or a kind a domain registers, e.g. ``money``,
    ``day``, ``hour``, ``unit``) and the other names evolved variants may give it."""

    name: str
    schema: dict[str, Any]
    required: bool = True
    kind: str = "plain"
    synonyms: tuple[str, ...] = ()


@dataclass(frozen=True)
class BaseTool:
    """A tool's canonical form: domain, family, description, parameters and semantics
    (``impl(world, canonical_args)``, acting on the episode's world in place)."""

    key: str
    domain: str
    family: str
    description: str
    params: tuple[Param, ...]
    impl: Callable[[dict[str, Any], dict[str, Any]], Any]
    read_only: bool = False
    list_key: str | None = None  # the result's list (partial / empty results truncate it)
    aliases: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------------ tasks


@dataclass
class Clarification:
    """A detail the request holds back: the agent asks ``question``; a question with any of ``keywords``
    gets ``answer`` from the user simulator."""

    slot: str
    question: str
    keywords: list[str]
    answer: str


@dataclass
class Step:
    """One call of the plan: a base tool key (or an MCP tool name) and canonical arguments;
    ``expect_error`` is the ToolError kind the call is meant to hit (an edge-case task)."""

    tool: str
    args: dict[str, Any] = field(default_factory=dict)
    expect_error: str | None = None


@dataclass
class Phase:
    """One user request, the calls that serve it, and the answer that closes it."""

    request: str
    steps: list[Step] = field(default_factory=list)
    answer: str = ""
    clarification: Clarification | None = None
    terms: list[str] = field(default_factory=list)  # facts the answer must state (empty: taken from it)


@dataclass
class Draft:
    """A task template's output before the agent and rubric are attached: phases (with the plan) and the
    domain's final-state checks (dicts with a ``kind`` the domain registers and a ``description``)."""

    kind: str
    phases: list[Phase]
    checks: list[dict[str, Any]]


#: A task template: draws a task from ``rng`` for ``world`` (which it may set up, e.g. put an event on the
#: calendar that the task then moves).
Template = Callable[[random.Random, dict[str, Any]], Draft]
#: A final-state check: ``(check, world, initial world, call log) -> problem or None``.
StateCheck = Callable[[dict, dict, dict, list], str | None]


# ---------------------------------------------------------------------------------------------- domains


@dataclass(frozen=True)
class Domain:
    """One tool domain: its world section, base tools, task templates and final-state checks.

    ``description`` completes the agent's system prompt ("an assistant for {description}"); ``prefixes``
    start the names of evolved variants; ``templates`` are drawn uniformly (list one twice to draw it twice
    as often); ``checks`` maps the check kinds the templates emit to their verifiers; ``initial_state(rng)``
    returns a fresh world section (``world[name]``); ``param_kinds`` maps a parameter kind the domain
    introduces to the codecs evolution may pick for it (besides the identity)."""

    name: str
    description: str
    prefixes: tuple[str, ...]
    tools: tuple[BaseTool, ...]
    templates: tuple[Template, ...]
    initial_state: Callable[[random.Random], dict[str, Any]]
    checks: dict[str, StateCheck] = field(default_factory=dict)
    param_kinds: dict[str, Callable[[], list[CodecOption]]] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- shared


def string(description: str) -> dict[str, Any]:
    """A string parameter's JSON schema."""
    return {"type": "string", "description": description}


def integer(description: str, minimum: int | None = None, maximum: int | None = None) -> dict[str, Any]:
    """An integer parameter's JSON schema, optionally bounded."""
    schema: dict[str, Any] = {"type": "integer", "description": description}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return schema


def money(value: float) -> float:
    """An amount rounded to cents."""
    return round(float(value), 2)


def day_name(day: str) -> str:
    """``"Wednesday"`` of ``"wed"``."""
    return FULL_DAYS[DAYS.index(day)].capitalize()


def clarify(rng: random.Random, probability: float = 0.3) -> bool:
    """Whether a task holds back a detail for the agent to ask about."""
    return rng.random() < probability


def day_codecs() -> list[CodecOption]:
    """Days spelled out, or as indices 0-6 from Monday."""
    full = Codec(
        "enum",
        mapping=tuple(zip(DAYS, FULL_DAYS, strict=True)),
        schema=(("enum", list(FULL_DAYS)),),
        note="days spelled out",
    )
    index = Codec(
        "enum",
        mapping=tuple((d, i) for i, d in enumerate(DAYS)),
        schema=(
            ("type", "integer"),
            ("enum", list(range(7))),
            ("description", "Day index, 0 = Monday ... 6 = Sunday."),
        ),
        note="days as 0-6 from Monday",
    )
    return [(full, ()), (index, ("day_index", "weekday_number"))]


QTY = Param("qty", integer("How many units.", 1), synonyms=("quantity", "count", "units", "n_items"))
DAY = Param(
    "day",
    {"type": "string", "enum": list(DAYS), "description": "Day of the week."},
    kind="day",
    synonyms=("weekday", "on_day", "day_of_week"),
)
#: The day as an optional filter (list events of one day, flights on one day).
OPTIONAL_DAY = replace(DAY, required=False)
