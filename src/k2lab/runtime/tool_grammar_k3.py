"""The decoding enforcer's grammar for Kimi K3's XTML tools channel (``k2lab.runtime.chat_k3``).

A section is the tools channel and the turn's close::

    <|open|>tools<|sep|>
      ( <|open|>call tool="{name}" index="{n}"<|sep|> {argument blocks} <|close|>call<|sep|> )+
    <|close|>tools<|sep|><|close|>message<|sep|>                      (then <|end_of_msg|>, the turn end)

with ``name`` a declared tool, ``n`` a positive integer (≤ 4 digits) and the argument blocks
``<|open|>argument key="{key}" type="{type}"<|sep|>{value}<|close|>argument<|sep|>``: one per declared
property, in declaration order, every required one present (at most once each: the declared properties
only, as K2's grammar closes objects). A property's value follows its schema by branch: a ``string``
branch is raw text (no ``<|`` in it, so no markup can be spelled out), ``minLength`` / ``maxLength`` and
an anchored or unanchored ``pattern`` as a regex intersected with that, an ``enum`` / ``const`` of
strings as the literals (``format`` is not enforced on raw strings); every other branch is JSON of that
type compiled by llguidance's ``%json`` from the property's schema, with closed objects and bounded
numbers as for K2 (``k2lab.runtime.enforcer.tool_schema``: integers within int64, no exponents) and the
root ``$defs`` / ``definitions`` attached. Branches come from ``type`` lists, ``anyOf`` / ``oneOf``, the
types of ``enum`` values, or (no type) every type. ``type`` is ``number`` for integers, as K3 writes them.

A forced section (``tool_choice`` required or a named function) starts at the first generated token:
the channels before it are closed empty (with thinking, ``<|close|>think<|sep|><|open|>response<|sep|>
<|close|>response<|sep|>``; without, ``<|close|>response<|sep|>``), as K2's forced section leaves no
text before it either.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from k2lab.runtime.chat_k3 import (
    CLOSE,
    END_OF_MSG,
    OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    SEP,
    THINK_CLOSE,
    TOOLS_OPEN,
    escape,
    xtml_type,
)
from k2lab.runtime.enforcer import JSON_OPTIONS, GrammarError, Markup, closed_objects, lark_string, tool_name
from k2lab.runtime.schema_bounds import bounded_numbers

__all__ = ["k3_markup", "tools_channel_lark"]

ALL_TYPES = ("string", "number", "boolean", "null", "object", "array")
NO_MARKUP = r"~/(?s:.*<\|.*)/"  # raw text never holds "<|"


def k3_markup(thinking: bool = True) -> Markup:
    """K3's tool-call markup for the enforcer (``thinking``: whether the generation prompt opened the think
    channel, which a forced section then closes)."""
    return Markup(
        TOOLS_OPEN, SEP, END_OF_MSG, (CLOSE, SEP, OPEN), partial(tools_channel_lark, thinking=thinking)
    )


def _marked(text: str) -> str:
    """Lark for markup text: special tokens bare, the words between them as string literals."""
    pieces, rest = [], text
    while rest:
        token = next((t for t in (OPEN, CLOSE, SEP, END_OF_MSG) if rest.startswith(t)), None)
        if token is not None:
            pieces.append(token)
            rest = rest[len(token) :]
            continue
        ends = [i for i in (rest.find(t) for t in (OPEN, CLOSE, SEP, END_OF_MSG)) if i > 0]
        cut = min(ends) if ends else len(rest)
        pieces.append(lark_string(rest[:cut]))
        rest = rest[cut:]
    return " ".join(pieces)


def tools_channel_lark(
    tools: Sequence[Mapping[str, Any]], parallel: bool = True, forced: bool = False, thinking: bool = True
) -> str:
    """The Lark grammar of one K3 section over ``tools`` (module doc)."""
    if not tools:
        raise GrammarError("a tool-call grammar needs at least one tool")
    prefix = ""
    if forced:
        prefix = _marked(THINK_CLOSE + RESPONSE_OPEN + RESPONSE_CLOSE if thinking else RESPONSE_CLOSE) + " "
    lines = [
        f"start: {prefix}{_marked(TOOLS_OPEN)} call{'+' if parallel else ''} "
        f"{_marked(f'{CLOSE}tools{SEP}{CLOSE}message{SEP}')}",
        f"call: {' | '.join(f'c{i}' for i in range(len(tools)))}",
        "INDEX: /[1-9][0-9]{0,3}/",
    ]
    for i, tool in enumerate(tools):
        lines += _call_rules(i, tool)
    return "\n".join(lines)


def _call_rules(i: int, tool: Mapping[str, Any]) -> list[str]:
    """``c{i}`` (one call of tool i) and the rules of its arguments."""
    function = tool.get("function", tool)
    root = closed_objects(function.get("parameters") or {"type": "object", "properties": {}})
    properties = dict(root.get("properties") or {})
    required = list(root.get("required") or [])
    properties.update({key: {} for key in required if key not in properties})
    defs = {key: root[key] for key in ("$defs", "definitions") if isinstance(root.get(key), dict)}
    header = lark_string(f'call tool="{escape(tool_name(tool))}" index="')
    parts, rules = [], []
    for j, (key, schema) in enumerate(properties.items()):
        branches = _branches(schema, defs)
        alternatives = []
        for b, (kind, value) in enumerate(branches):
            head = _marked(f'{OPEN}argument key="{escape(key)}" type="{kind}"{SEP}')
            if value.startswith("/"):  # a raw-string regex: a terminal of its own
                rules.append(f"S{i}_{j}_{b}: {value}")
                value = f"S{i}_{j}_{b}"
            alternatives.append(f"{head} ({value}) {_marked(f'{CLOSE}argument{SEP}')}")
        rules.append(f"a{i}_{j}: " + " | ".join(alternatives))
        parts.append(f"a{i}_{j}" + ("" if key in required else "?"))
    body = " ".join(parts)
    rules.insert(0, f'c{i}: {OPEN} {header} INDEX "\\"" {SEP} {body} {_marked(f"{CLOSE}call{SEP}")}')
    return rules


def _resolved(schema: Any, defs: Mapping[str, Any]) -> Any:
    """``schema`` with a local ``$ref`` (``#/$defs/X``, ``#/definitions/X``) followed, up to 8 deep."""
    for _ in range(8):
        ref = schema.get("$ref") if isinstance(schema, Mapping) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            return schema
        section, _, name = ref[2:].partition("/")
        target = defs.get(section, {}).get(name)
        if target is None:
            raise GrammarError(f"unresolvable $ref {ref!r} in a tool's parameters")
        schema = {**{k: v for k, v in schema.items() if k != "$ref"}, **target}
    return schema


def _branches(schema: Any, defs: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(type attribute, Lark value)`` for each way a property's value can be written."""
    schema = _resolved(schema, defs) if isinstance(schema, Mapping) else {}
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list):
        return _enum_branches(values, defs)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            rest = {k: v for k, v in schema.items() if k != key}
            return [b for sub in schema[key] for b in _branches({**rest, **sub}, defs)]
    kind = schema.get("type")
    if isinstance(kind, list):
        return [b for t in kind for b in _branches({**schema, "type": t}, defs)]
    if kind is None:
        kinds = ("object",) if "properties" in schema else ("array",) if "items" in schema else ALL_TYPES
        return [b for t in kinds for b in _branches({**schema, "type": t}, defs)]
    if kind == "string":
        return [("string", _raw_string(schema))]
    return [("number" if kind == "integer" else kind, _json(schema, defs))]


def _enum_branches(values: list[Any], defs: Mapping[str, Any]) -> list[tuple[str, str]]:
    strings = [v for v in values if isinstance(v, str)]
    branches = [("string", " | ".join(lark_string(v) for v in strings))] if strings else []
    for kind in ALL_TYPES[1:]:
        typed = [v for v in values if xtml_type(v) == kind]
        if typed:
            branches.append((kind, _json({"enum": typed}, defs)))
    return branches


def _json(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> str:
    return "%json " + json.dumps({**bounded_numbers({**schema, **defs}), "x-guidance": JSON_OPTIONS})


def _raw_string(schema: Mapping[str, Any]) -> str:
    """A regex for a raw string value: its length bounds and pattern, never ``<|``."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    length = f"/(?s:.{{{int(low)},{'' if high is None else int(high)}}})/"
    pattern = schema.get("pattern")
    parts = [length, NO_MARKUP]
    if isinstance(pattern, str):
        start = "" if pattern.startswith("^") else "(?s:.*)"
        end = "" if pattern.endswith("$") and not pattern.endswith("\\$") else "(?s:.*)"
        core = pattern.removeprefix("^").removesuffix("$") if end == "" else pattern.removeprefix("^")
        regex = f"{start}(?:{core}){end}"
        parts.append("/" + regex.replace("/", "\\/") + "/")
    return " & ".join(parts)
