"""The data factory's tool domains, one module each, and their registry.

A domain module (``retail``, ``calendar``, ``bank``, ``files``, ``math``, ``inventory``, ``travel``) holds
everything of its domain: its world section (``initial_state``), its base tools (canonical parameters and
stateful semantics), its task templates (which draw a task and its plan from the world) with their data
tables (titles, passengers, phrases ...), and the final-state checks its templates emit. It ends with one
``DOMAIN = Domain(...)`` record (``k2lab.agentic.domains.base``). ``no_tool`` holds the domain-free drafts
(small talk answered without a tool).

This registry lists the domains and merges what the machinery needs from them: ``DOMAINS`` (name ->
``Domain``), ``BASE_TOOLS`` / ``BASES`` (every base tool, in domain order / by key) for the tool repository
(``k2lab.agentic.factory.tools``), ``CHECKS`` (check kind -> verifier) for the judge
(``k2lab.agentic.factory.judge``), ``PARAM_KINDS`` (parameter kind -> codecs) for tool evolution, and
``initial_world``; task generation (``k2lab.agentic.factory.tasks``) draws from ``DOMAINS[name].templates``.

Adding a domain
---------------
1. Write ``domains/<name>.py`` after an existing one (``files.py`` is the shortest): ``initial_state(rng)``
   returning the fresh ``world[<name>]`` section; tool functions ``impl(world, canonical_args)`` that raise
   ``ToolError(kind, message)`` for domain errors and return JSON-able dicts; a ``TOOLS`` tuple of
   ``BaseTool`` (parameters as ``Param`` with their synonyms); task templates ``(rng, world) -> Draft``
   whose plans use only the domain's tools (the generator rehearses every plan on a copy of the world, so
   an infeasible template fails loudly); the check functions of the check kinds the templates emit; and
   ``DOMAIN = Domain(name, description, prefixes, TOOLS, templates, initial_state, checks, param_kinds)``.
2. Register it here: import the module, append its ``DOMAIN`` to ``DOMAINS`` and its name to the end of
   ``WORLD_DRAW_ORDER`` (so the existing world sections are drawn as before).
3. Test it: ``tests/agentic/domains/test_domains.py`` checks every registered domain (its tools, that its templates
   are feasible and emit registered checks, that the expert solves them). A new domain changes the tasks
   of existing seeds (a seed draws its domain among all of them; evolution round-robins over all base
   tools): update the digest pinned there in the same commit. See ``docs/agentic-domains.md``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from k2lab.agentic.domains import bank, calendar, files, inventory, math, retail, travel
from k2lab.agentic.domains.base import BaseTool, CodecOption, Domain, StateCheck, day_codecs

__all__ = ["BASES", "BASE_TOOLS", "CHECKS", "DOMAINS", "PARAM_KINDS", "WORLD_DRAW_ORDER", "initial_world"]

#: The domains, in the order their tools enter the repository.
DOMAINS: dict[str, Domain] = {
    domain.name: domain
    for domain in (
        retail.DOMAIN,
        calendar.DOMAIN,
        bank.DOMAIN,
        files.DOMAIN,
        math.DOMAIN,
        inventory.DOMAIN,
        travel.DOMAIN,
    )
}
#: The order in which the domains draw their world sections from a task's random stream (travel's flights
#: before inventory's stock, as the world was first written): part of every seed's world, so a new domain
#: goes at the end.
WORLD_DRAW_ORDER = ("retail", "calendar", "bank", "files", "math", "travel", "inventory")


def _merged(what: str, tables: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One table of several; a key in two of them is an error."""
    merged: dict[str, Any] = {}
    for table in tables:
        for key, value in table.items():
            if key in merged:
                raise ValueError(f"two domains register the {what} {key!r}")
            merged[key] = value
    return merged


def _check_registry() -> None:
    """Every tool belongs to the domain that lists it, tool keys are unique, the draw order is complete."""
    for name, domain in DOMAINS.items():
        strays = [tool.key for tool in domain.tools if tool.domain != name]
        if strays:
            raise ValueError(f"domain {name!r} lists tools of another domain: {strays}")
    if len(BASES) != len(BASE_TOOLS):
        raise ValueError("two base tools share a key")
    if sorted(WORLD_DRAW_ORDER) != sorted(DOMAINS):
        raise ValueError("WORLD_DRAW_ORDER must list every domain once")


#: Every base tool, domain by domain.
BASE_TOOLS: tuple[BaseTool, ...] = tuple(tool for domain in DOMAINS.values() for tool in domain.tools)
BASES: dict[str, BaseTool] = {tool.key: tool for tool in BASE_TOOLS}
#: Final-state check kind -> verifier, of every domain (the judge adds the generic ``unchanged``, ``called``).
CHECKS: dict[str, StateCheck] = _merged("check kind", (domain.checks for domain in DOMAINS.values()))
#: Parameter kind -> the codecs (besides the identity) evolution may pick for it.
PARAM_KINDS: dict[str, Callable[[], list[CodecOption]]] = _merged(
    "parameter kind", ({"day": day_codecs}, *(domain.param_kinds for domain in DOMAINS.values()))
)
_check_registry()


def initial_world(rng: random.Random) -> dict[str, Any]:
    """A fresh world with one section per domain, randomised by ``rng`` (drawn in ``WORLD_DRAW_ORDER``)."""
    sections = {name: DOMAINS[name].initial_state(rng) for name in WORLD_DRAW_ORDER}
    return {name: sections[name] for name in DOMAINS}
