"""Bounded numbers for the decoding enforcer: a tool's JSON Schema rewritten so no number can run on.

JSON Schema's ``integer`` and ``number`` have no length: a grammar compiled from them lets a model write
``"days": 28224200902592970006211473842566251822…`` until it runs out of tokens. Before the schema is
compiled (llguidance, whose JSON compiler enforces ``minimum`` / ``maximum`` / ``exclusiveMinimum`` /
``exclusiveMaximum`` / ``multipleOf`` for numbers, ``minLength`` / ``maxLength`` / ``pattern`` for
strings and ``minItems`` / ``maxItems`` for arrays itself), every numeric subschema gets bounds:

- ``integer``: ``-I ≤ x ≤ 2^63 − 1`` with ``I = 2^63 − 1024`` — within int64, at most 19 digits. (The
  compiler reads bounds as float64, and ``−2^63`` overflows its range-to-regex conversion; ``2^63 − 1024``
  is the largest float64 below ``2^63``.)
- ``number``: ``anyOf`` [an int64 integer as above, a decimal with ``|x| ≤ 10^11`` and at most 6 decimal
  places (``multipleOf: 1e-6``)]: at most 17 significant digits (float64's round-trip precision), no
  exponent.

A bound the schema already gives is kept where it is tighter (and a schema's own ``multipleOf`` replaces
the 6-place default), so every value the rewritten schema accepts is valid for the original one; the
arguments are still validated against the original. ``type`` lists holding ``integer`` or ``number`` are
split into an ``anyOf`` of one subschema per type. ``enum``, ``const``, ``default`` and ``examples`` are
data, not schemas, and are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["DATA_KEYS", "DECIMAL_LIMIT", "DECIMAL_STEP", "INT_MAX", "INT_MIN", "bounded_numbers"]

INT_MAX = 2**63 - 1
INT_MIN = -(2**63 - 1024)
DECIMAL_LIMIT = 10**11  # 11 integer digits + 6 decimal places = 17 significant digits
DECIMAL_STEP = 1e-6
DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


def _clamped(schema: dict[str, Any], low: float, high: float) -> dict[str, Any]:
    """``schema`` with ``low ≤ x ≤ high`` added where it has no tighter lower / upper bound of its own."""
    lower = [schema[k] for k in ("minimum", "exclusiveMinimum") if isinstance(schema.get(k), int | float)]
    upper = [schema[k] for k in ("maximum", "exclusiveMaximum") if isinstance(schema.get(k), int | float)]
    if not lower or max(lower) < low:
        schema = {k: v for k, v in schema.items() if k not in ("minimum", "exclusiveMinimum")}
        schema["minimum"] = low
    if not upper or min(upper) > high:
        schema = {k: v for k, v in schema.items() if k not in ("maximum", "exclusiveMaximum")}
        schema["maximum"] = high
    return schema


def _bounded_number(schema: dict[str, Any]) -> dict[str, Any]:
    if schema["type"] == "integer":
        return _clamped(schema, INT_MIN, INT_MAX)
    integer = _clamped({**schema, "type": "integer"}, INT_MIN, INT_MAX)
    decimal = _clamped({"multipleOf": DECIMAL_STEP, **schema}, -DECIMAL_LIMIT, DECIMAL_LIMIT)
    if "multipleOf" in schema:  # its own step: integers that are not multiples of it are not allowed
        return decimal
    return {"anyOf": [integer, decimal]}


def bounded_numbers(schema: Any) -> Any:
    """``schema`` (a JSON Schema, any nesting) with every ``integer`` / ``number`` bounded (module doc)."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: v if k in DATA_KEYS else bounded_numbers(v) for k, v in schema.items()}
    if "enum" in schema or "const" in schema:
        return out
    kind = schema.get("type")
    if isinstance(kind, list) and any(t in ("integer", "number") for t in kind):
        rest = {k: v for k, v in schema.items() if k != "type"}
        return {"anyOf": [bounded_numbers({**rest, "type": t}) for t in kind]}
    if kind in ("integer", "number"):
        return _bounded_number(out)
    return out
