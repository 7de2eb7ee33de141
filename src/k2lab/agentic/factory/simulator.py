"""The stateful tool simulator: runs tool calls against an episode's world, with injected failures.

``ToolSimulator.execute(world, name, arguments, seed, call_index)`` never raises. It returns an
``Observation`` whose ``content`` is the JSON text of the ``role: tool`` message:

* ``{"ok": true, "result": ...}`` on success, with ``"partial": true`` / ``"empty": true`` and a ``note``
  when a list result was truncated or emptied by injection;
* ``{"ok": false, "error": {"type", "message", "retryable"}}`` otherwise: ``malformed_arguments`` (not a
  JSON object), ``unknown_tool``, ``invalid_arguments`` (fails the tool's JSON schema, via ``jsonschema``),
  the tool's own ``ToolError`` kind (``insufficient_funds`` ...), ``tool_crashed`` (any other exception),
  and the injected ``service_unavailable`` / ``rate_limited`` (retryable; the world is left untouched).

Injection is deterministic: call ``call_index`` of the episode with seed ``seed`` draws from
``random.Random(f"{seed}:{call_index}")``. A transient error strikes with probability ``transient``, a rate
limit with ``rate_limit``; a successful call of a tool with a list result is then truncated to about half
with ``partial`` and emptied with ``empty`` (the world still changes only through the tool's semantics).
Spec-only (harvested MCP) tools get a schema-conforming invented result (``output_schema`` when known).
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any

from jsonschema.protocols import Validator

from k2lab.agentic.domains.base import ToolError
from k2lab.agentic.factory.tools import SyntheticTool, ToolRepository
from k2lab.runtime.tool_spec import json_schema_problems, schema_validator

__all__ = ["FailureRates", "Observation", "ToolSimulator", "error_observation", "invent_value"]

RETRYABLE = ("service_unavailable", "rate_limited")


@dataclass(frozen=True)
class FailureRates:
    """Probabilities of the injected failures and edge cases (per call)."""

    transient: float = 0.0
    rate_limit: float = 0.0
    partial: float = 0.0
    empty: float = 0.0

    @classmethod
    def from_total(cls, rate: float) -> FailureRates:
        """Split one failure rate: half transient errors, a fifth rate limits, the rest edge-case results."""
        return cls(transient=0.5 * rate, rate_limit=0.2 * rate, partial=0.15 * rate, empty=0.15 * rate)


@dataclass
class Observation:
    """One tool call's outcome: ``kind`` is ``ok``, ``partial``, ``empty`` or an error type."""

    ok: bool
    kind: str
    content: str
    result: Any = None
    retryable: bool = False
    reason: str = ""


def error_observation(kind: str, message: str) -> Observation:
    """A failed call's observation (``retryable`` for the injected transient kinds)."""
    retryable = kind in RETRYABLE
    body = {"ok": False, "error": {"type": kind, "message": message, "retryable": retryable}}
    return Observation(False, kind, json.dumps(body, ensure_ascii=False), retryable=retryable, reason=message)


def _success(result: Any, kind: str = "ok", note: str = "") -> Observation:
    body: dict[str, Any] = {"ok": True, "result": result}
    if kind != "ok":
        body[kind] = True
        body["note"] = note
    return Observation(True, kind, json.dumps(body, ensure_ascii=False), result=result)


class ToolSimulator:
    """Executes tool calls of a repository's tools on a world state, injecting failures at ``rates``."""

    def __init__(self, repository: ToolRepository, rates: FailureRates | None = None):
        self.repository = repository
        self.rates = rates or FailureRates()
        self._validators: dict[str, Validator | None] = {}

    def execute(
        self, world: dict[str, Any], name: str, arguments: Any, seed: int = 0, call_index: int = 0
    ) -> Observation:
        """Run one call (``arguments``: a JSON-object string or a dict); never raises."""
        try:
            return self._execute(world, name, arguments, random.Random(f"{seed}:{call_index}"))
        except Exception as error:  # noqa: BLE001 - a simulator bug must not end a rollout with a traceback
            return error_observation(
                "tool_crashed", f"the tool failed unexpectedly: {type(error).__name__}: {error}"
            )

    def _execute(self, world: dict[str, Any], name: str, arguments: Any, rng: random.Random) -> Observation:
        if not isinstance(name, str) or (
            name not in self.repository.synthetic and name not in self.repository.mcp
        ):
            return error_observation("unknown_tool", f"there is no tool named {name!r}")
        parsed = _parse_arguments(arguments)
        if isinstance(parsed, str):
            return error_observation("malformed_arguments", parsed)
        problems = self._schema_problems(name, parsed)
        if problems:
            return error_observation("invalid_arguments", "; ".join(problems))
        draw = rng.random()
        if draw < self.rates.transient:
            return error_observation("service_unavailable", "service unavailable, please retry")
        if draw < self.rates.transient + self.rates.rate_limit:
            return error_observation("rate_limited", "rate limit exceeded, retry after a moment")
        tool = self.repository.synthetic.get(name)
        if tool is None:
            return _success(self._invent(name, parsed, rng))
        return self._run(tool, world, parsed, rng)

    def _run(
        self, tool: SyntheticTool, world: dict[str, Any], arguments: dict, rng: random.Random
    ) -> Observation:
        try:
            result = tool.execute(world, arguments)
        except ToolError as error:
            return error_observation(error.kind, str(error))
        key = tool.base.list_key
        if key is None or not isinstance(result, dict) or not isinstance(result.get(key), list):
            return _success(result)
        draw = rng.random()
        if draw < self.rates.partial and len(result[key]) > 1:
            result = {**result, key: result[key][: (len(result[key]) + 1) // 2]}
            return _success(result, "partial", "partial results: the backend timed out, retry for the rest")
        if self.rates.partial <= draw < self.rates.partial + self.rates.empty:
            return _success({**result, key: []}, "empty", "no results returned by the index; try again")
        return _success(result)

    def _schema_problems(self, name: str, arguments: dict[str, Any]) -> list[str]:
        """The first problems of ``arguments`` under the tool's schema (none when the schema itself is
        unusable: invalid, or with a ``$ref`` that does not resolve; remote ones are never fetched)."""
        if name not in self._validators:
            schema = self.repository.spec(name)["function"].get("parameters") or {"type": "object"}
            self._validators[name] = None if json_schema_problems(schema) else schema_validator(schema)
        validator = self._validators[name]
        if validator is None:
            return []
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        return [f"{'/'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}" for e in errors[:5]]

    def _invent(self, name: str, arguments: dict[str, Any], rng: random.Random) -> Any:
        """A plausible result of a spec-only tool: from its output schema, else a generic record."""
        record = self.repository.mcp[name]
        schema = record.get("output_schema")
        if isinstance(schema, dict) and schema:
            return invent_value(schema, rng)
        return {
            "status": "success",
            "tool": name,
            "arguments": copy.deepcopy(arguments),
            "summary": f"{name} completed",
            "items": rng.randint(0, 5),
        }


def _parse_arguments(arguments: Any) -> dict[str, Any] | str:
    """The arguments as a dict, or a string saying why they are malformed."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or arguments == "":
        return {}
    if not isinstance(arguments, str):
        return f"arguments must be a JSON object string, got {type(arguments).__name__}"
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError) as error:
        return f"arguments are not valid JSON ({error})"
    return (
        value if isinstance(value, dict) else f"arguments must be a JSON object, got {type(value).__name__}"
    )


WORDS = ("alpha", "beta", "gamma", "delta", "report", "result", "item", "value")


def invent_value(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A value conforming to a (simple) JSON schema: enum/const, type, object properties, array items."""
    if not isinstance(schema, dict) or depth > 6:
        return None
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return invent_value(schema[key][0], rng, depth + 1)
    kind = schema.get("type")
    kind = next((k for k in kind if k != "null"), "null") if isinstance(kind, list) else kind
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties") or {}
        return {key: invent_value(sub, rng, depth + 1) for key, sub in properties.items()}
    if kind == "array":
        return [invent_value(schema.get("items") or {"type": "string"}, rng, depth + 1) for _ in range(2)]
    if kind == "integer":
        low = int(schema.get("minimum", 0))
        return rng.randint(low, max(low, int(schema.get("maximum", low + 100))))
    if kind == "number":
        low = float(schema.get("minimum", 0))
        return round(rng.uniform(low, float(schema.get("maximum", low + 100))), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        return f"{rng.choice(WORDS)}-{rng.randint(1, 999)}"
    return None
