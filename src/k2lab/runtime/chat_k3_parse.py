"""Parsing Kimi K3's XTML text back into OpenAI messages (the format is in ``k2lab.runtime.chat_k3``).

``parse_assistant_k3`` reads a generated assistant turn (the text after the generation prompt, which
opened the think channel, or the response channel with thinking off): reasoning, content and tool
calls, each argument block decoded by its ``type`` (a ``string`` raw, every other type as JSON of that
type) and the arguments returned as ``json.dumps(dict, ensure_ascii=False)``; the released encoder's
``<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>`` block is read too. A turn may end with
``<|close|>message<|sep|>`` and ``<|end_of_msg|>``; a response channel cut short (``max_tokens``) is content
as far as it goes. ``parse_chat_k3`` reads a rendered conversation. Both raise ``ToolCallParseError``
listing every problem found (unclosed think or tools channels, markup inside a channel's text, bad call
or argument tags, values that are not of their declared type, text after the turn).

Ids: the k-th call of the conversation (from 0; ``first_index`` for a turn parsed alone) is
``functions.{name}:{k}``, whatever index the model wrote (the released parsers ignore it too; it must be
a positive integer). A tool result ``tool="{name}" index="{n}"`` answers call n of the assistant turn
before it.
"""

from __future__ import annotations

import json
from typing import Any

from k2lab.runtime.chat import ToolCallParseError, tool_call_id
from k2lab.runtime.chat_json import loads_strict
from k2lab.runtime.chat_k3 import (
    ARGUMENT_CLOSE,
    CALL_CLOSE,
    CLOSE,
    END_OF_MSG,
    MESSAGE_CLOSE,
    OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    SEP,
    THINK_CLOSE,
    THINK_OPEN,
    TOOLS_CLOSE,
    TOOLS_OPEN,
    check_no_markup,
    close_tag,
    parse_header,
    raise_if,
    xtml_type,
)
from k2lab.runtime.tool_spec import TOOL_NAME_PATTERN

__all__ = ["parse_assistant_k3", "parse_chat_k3"]

INTERNAL_TYPES = ("tool-declare", "thinking-effort", "tool-choice", "response-format")
VALUE_TYPES = ("string", "number", "boolean", "null", "object", "array")


def _preview(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_assistant_k3(text: str, thinking: bool = True, first_index: int = 0) -> dict[str, Any]:
    """An OpenAI assistant message from a generated turn (module doc); ``content`` is None when empty and
    there are tool calls, ``reasoning_content`` is there when the reasoning is not blank."""
    if not isinstance(text, str):
        raise ToolCallParseError([f"expected a string, got {type(text).__name__}"])
    return _parse_body((THINK_OPEN if thinking else RESPONSE_OPEN) + text, thinking, first_index)


def _parse_body(body: str, thinking: bool, first_index: int) -> dict[str, Any]:
    """An assistant turn's body from its first channel opener on."""
    problems: list[str] = []
    position, reasoning = 0, None
    if thinking:
        if not body.startswith(THINK_OPEN):
            raise ToolCallParseError([f"expected {THINK_OPEN}, found {_preview(body)}"])
        close = body.find(THINK_CLOSE)
        if close < 0:
            raise ToolCallParseError([f"{THINK_OPEN} is never closed by {THINK_CLOSE}"])
        reasoning = body[len(THINK_OPEN) : close]
        check_no_markup(reasoning, "think channel", problems)
        position = close + len(THINK_CLOSE)
    if not body.startswith(RESPONSE_OPEN, position):
        raise ToolCallParseError([*problems, f"expected {RESPONSE_OPEN}, found {_preview(body[position:])}"])
    start = position + len(RESPONSE_OPEN)
    close = body.find(RESPONSE_CLOSE, start)
    content = body[start:] if close < 0 else body[start:close]
    check_no_markup(content, "response channel", problems)
    calls: list[dict[str, Any]] = []
    if close >= 0:
        position = close + len(RESPONSE_CLOSE)
        if body.startswith(TOOLS_OPEN, position):
            calls, position = _parse_tools(body, position + len(TOOLS_OPEN), first_index, problems)
        tail = body[position:]
        if tail not in ("", MESSAGE_CLOSE, MESSAGE_CLOSE + END_OF_MSG):
            problems.append(f"text after the response and tools channels: {_preview(tail)}")
    raise_if(problems)
    message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content else content}
    if reasoning is not None and reasoning.strip():
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _parse_tools(body: str, start: int, first_index: int, problems: list[str]) -> tuple[list[dict], int]:
    """The calls of a tools channel whose opener ends at ``start``, and the position after it."""
    end = body.find(TOOLS_CLOSE, start)
    if end < 0:
        problems.append(f"{TOOLS_OPEN} is never closed by {TOOLS_CLOSE}")
    section = body[start:] if end < 0 else body[start:end]
    calls: list[dict[str, Any]] = []
    position, number = 0, 0
    while section[position:].strip():
        number += 1
        where = f"tool call {number}"
        position = len(section) - len(section[position:].lstrip())
        header_end = section.find(SEP, position)
        attrs = parse_header(section[position + len(OPEN) : header_end], "call") if header_end > 0 else None
        if not section.startswith(OPEN, position) or attrs is None:
            problems.append(
                f'{where}: expected {OPEN}call tool="NAME" index="N"{SEP}, found {_preview(section[position:])}'
            )
            break
        close = section.find(CALL_CLOSE, header_end)
        if close < 0:
            problems.append(f"{where}: never closed by {CALL_CLOSE}")
            close = len(section)
        inner = section[header_end + len(SEP) : close]
        call = _parse_call(attrs, inner, where, problems, tool_call_index=first_index + len(calls))
        if call is not None:
            calls.append(call)
        position = close + len(CALL_CLOSE)
    if number == 0:
        problems.append("the tools channel holds no calls")
    return calls, len(body) if end < 0 else end + len(TOOLS_CLOSE)


def _parse_call(
    attrs: dict[str, str], inner: str, where: str, problems: list[str], tool_call_index: int
) -> dict[str, Any] | None:
    count = len(problems)
    name, index = attrs.get("tool"), attrs.get("index", "")
    if name is None or not TOOL_NAME_PATTERN.match(name):
        problems.append(f"{where}: tool name {name!r} does not match ^[a-zA-Z0-9_-]{{1,64}}$")
    if not index.isdigit() or int(index) < 1:
        problems.append(f"{where}: index {index!r} is not a positive integer")
    arguments = _parse_arguments(inner, where, problems)
    if len(problems) > count or arguments is None:
        return None
    return {
        "id": tool_call_id(name, tool_call_index),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _parse_arguments(inner: str, where: str, problems: list[str]) -> dict[str, Any] | None:
    """A call's argument blocks (or its one ``json`` block) as a dict; None (problems noted) if malformed."""
    if inner.startswith(OPEN + "json"):
        return _parse_json_block(inner, where, problems)
    arguments: dict[str, Any] = {}
    position = 0
    while inner[position:].strip():
        position = len(inner) - len(inner[position:].lstrip())
        header_end = inner.find(SEP, position)
        attrs = parse_header(inner[position + len(OPEN) : header_end], "argument") if header_end > 0 else None
        if not inner.startswith(OPEN, position) or attrs is None or "key" not in attrs:
            problems.append(
                f'{where}: expected {OPEN}argument key="K" type="T"{SEP}, found {_preview(inner[position:])}'
            )
            return None
        close = inner.find(ARGUMENT_CLOSE, header_end)
        if close < 0:
            problems.append(f"{where}: argument {attrs['key']!r} is never closed by {ARGUMENT_CLOSE}")
            return None
        value, problem = _typed_value(inner[header_end + len(SEP) : close], attrs.get("type", "string"))
        if problem is None and attrs["key"] in arguments:
            problem = "given more than once"
        if problem:
            problems.append(f"{where}: argument {attrs['key']!r}: {problem}")
            return None
        arguments[attrs["key"]] = value
        position = close + len(ARGUMENT_CLOSE)
    return arguments


def _typed_value(raw: str, kind: str) -> tuple[Any, str | None]:
    """The value an argument block's text holds as its ``type`` says, and a problem (None when it is fine)."""
    if kind not in VALUE_TYPES:
        return None, f"unknown type {kind!r}"
    if any(token in raw for token in (OPEN, CLOSE, SEP, END_OF_MSG)):
        return None, f"markup inside the value {_preview(raw)}"
    if kind == "string":
        return raw, None
    try:
        value = loads_strict(raw)
    except (ValueError, RecursionError) as error:
        return None, f"{kind} value is not valid JSON ({error}): {_preview(raw)}"
    if xtml_type(value) != kind:
        return None, f"declared {kind} but the value is {xtml_type(value)}: {_preview(raw)}"
    return value, None


def _parse_json_block(inner: str, where: str, problems: list[str]) -> dict[str, Any] | None:
    header_end = inner.find(SEP)
    close = inner.find(close_tag("json"))
    if header_end < 0 or close < 0 or inner[close + len(close_tag("json")) :].strip():
        problems.append(f"{where}: a json block must be the whole call body, closed by {close_tag('json')}")
        return None
    try:
        value = loads_strict(inner[header_end + len(SEP) : close])
    except (ValueError, RecursionError) as error:
        problems.append(f"{where}: the json block is not valid JSON ({error})")
        return None
    if not isinstance(value, dict):
        problems.append(f"{where}: the json block must hold a JSON object, got {type(value).__name__}")
        return None
    return value


def parse_chat_k3(text: str, thinking: bool = True) -> list[dict[str, Any]]:
    """The messages of a rendered conversation, as ``normalize_messages_k3`` writes them.

    Synthesised system turns (tool declarations, effort and tool-choice notes) are skipped, a trailing
    generation prompt is ignored and an unterminated last assistant turn is parsed as far as it goes.
    """
    if not isinstance(text, str):
        raise ToolCallParseError([f"expected a string, got {type(text).__name__}"], "conversation")
    state = _ChatState()
    position = 0
    while position < len(text):
        number = len(state.messages) + 1
        header_end = text.find(SEP, position)
        attrs = parse_header(text[position + len(OPEN) : header_end], "message") if header_end > 0 else None
        if not text.startswith(OPEN, position) or attrs is None:
            found = _preview(text[position:])
            raise ToolCallParseError(
                [f'at character {position}: expected {OPEN}message role="..."{SEP}, found {found}'],
                "conversation",
            )
        start = header_end + len(SEP)
        end = text.find(MESSAGE_CLOSE, start)
        role = attrs.get("role")
        if end < 0 and role != "assistant":
            raise ToolCallParseError(
                [f"turn {number} ({role}) is never closed by {MESSAGE_CLOSE}"], "conversation"
            )
        if end >= 0 and not text.startswith(END_OF_MSG, end + len(MESSAGE_CLOSE)):
            raise ToolCallParseError(
                [f"turn {number} ({role}): {MESSAGE_CLOSE} not followed by {END_OF_MSG}"], "conversation"
            )
        body = text[start:] if end < 0 else text[start:end]
        if end >= 0 or body not in (THINK_OPEN if thinking else RESPONSE_OPEN, ""):
            try:
                state.turn(attrs, body, thinking)
            except ToolCallParseError as error:
                problems = [f"turn {number} ({role}): {p}" for p in error.problems]
                raise ToolCallParseError(problems, "conversation") from None
        position = len(text) if end < 0 else end + len(MESSAGE_CLOSE) + len(END_OF_MSG)
    return state.messages


class _ChatState:
    """Messages parsed so far, the latest assistant turn's calls and the tool results answering them."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.count = 0  # tool calls so far in the conversation
        self.results = 0  # tool results since the latest assistant turn

    def turn(self, attrs: dict[str, str], body: str, thinking: bool) -> None:
        role, kind = attrs.get("role"), attrs.get("type")
        if role == "assistant":
            message = _parse_body(body, thinking, self.count)
            self.calls, self.results = message.get("tool_calls", []), 0
            self.count += len(self.calls)
            self.messages.append(message)
            return
        problems: list[str] = []
        check_no_markup(body, f"{role} turn", problems)
        raise_if(problems)
        if role == "system" and kind in INTERNAL_TYPES:
            return
        if role in ("system", "user") and kind is None:
            self.messages.append({"role": role, "content": body})
        elif role == "tool":
            self.messages.append({"role": "tool", "tool_call_id": self._answered(attrs), "content": body})
        else:
            raise ToolCallParseError([f"unknown turn role={role!r} type={kind!r}"])
        if role != "tool":
            self.calls, self.results = [], 0

    def _answered(self, attrs: dict[str, str]) -> str:
        """The id of the call a tool result answers (call ``index`` of the latest assistant turn)."""
        self.results += 1
        index, name = attrs.get("index", ""), attrs.get("tool")
        if index != str(self.results) or self.results > len(self.calls):
            raise ToolCallParseError([f"index {index!r}: expected {self.results} of {len(self.calls)} calls"])
        call = self.calls[self.results - 1]
        if call["function"]["name"] != name:
            raise ToolCallParseError(
                [f"tool {name!r} answers call {index}, a call of {call['function']['name']!r}"]
            )
        return call["id"]
