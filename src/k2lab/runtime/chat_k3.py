"""Kimi K3's chat and tool-call format (XTML): render OpenAI-style messages to text, parse generated text back.

K3 ships no Jinja template: its checkpoint renders prompts with a Python program (``encoding_k3.py``).
This module follows that program as the released parsers and grammars read it (SGLang
``function_call/kimik3_format.py``, vLLM ``tool_parsers/kimi_k3_tool_parser.py``,
``reasoning/kimi_k3_reasoning_parser.py``, ``renderers/kimi_k3.py`` and the ``kimi_k3`` structural tag,
mlx-lm ``tool_parsers/kimi_k3.py``). The markup is XML-like; its brackets are four special tokens,
``<|open|>``, ``<|close|>``, ``<|sep|>`` and ``<|end_of_msg|>``; an element is
``<|open|>NAME[ KEY="VALUE"]*<|sep|>BODY<|close|>NAME<|sep|>`` with attribute values escaped ``&`` ->
``&amp;`` then ``"`` -> ``&quot;`` (bodies are raw). Turns follow each other with no separator::

    <|open|>message role="system" type="tool-declare"<|sep|># Tools\\n...```json\\n{tools}\\n```<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="system" type="thinking-effort"<|sep|>...<|close|>message<|sep|><|end_of_msg|>   (thinking_effort)
    <|open|>message role="system"<|sep|>{content}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>{content}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" tool="{name}" index="{n}"<|sep|>{content}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="system" type="tool-choice"<|sep|>...<|close|>message<|sep|><|end_of_msg|>  (required / none)
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>          (generation prompt; thinking off: response)

An assistant body is ``<|open|>think<|sep|>{reasoning}<|close|>think<|sep|>`` (thinking mode: always
there, empty without reasoning; absent with thinking off), then ``<|open|>response<|sep|>{content}
<|close|>response<|sep|>`` (always), then, with tool calls, one tools channel::

    <|open|>tools<|sep|>
      <|open|>call tool="{name}" index="{k}"<|sep|>
        <|open|>argument key="{key}" type="{type}"<|sep|>{value}<|close|>argument<|sep|>   (one per key)
      <|close|>call<|sep|>                                                                (one per call)
    <|close|>tools<|sep|>

(written without the line breaks shown). ``index`` is the call's 1-based position in its turn; ``type``
is ``string`` / ``number`` / ``boolean`` / ``null`` / ``object`` / ``array`` (the value's JSON type, integers
are numbers), a string value is written raw and every other value as ``json.dumps(value,
ensure_ascii=False)``. Tools are declared as compact JSON (keys sorted at every depth, as the released
encoder does). A tool result names the call it answers by tool name and the call's index (no id).

Decisions where the released code leaves room, or that k2lab's interface needs:

* OpenAI ids are ``functions.{name}:{idx}`` with idx global over the conversation, as in K2's format
  (``k2lab.runtime.chat``), so clients and rollouts bind results the same way for both families; they
  are not rendered. The tool results after an assistant turn are put in call order (as vLLM's K3 renderer
  does) and must answer its calls 1, 2, ..., k once each (what the index-only binding can carry back);
  anything else raises ``ChatFormatError``.
* Arguments are canonical: ``json.dumps(json.loads(arguments), ensure_ascii=False)`` (what parsing the
  typed argument blocks gives back). The released encoder's ``json`` block for arguments that are not
  JSON is parsed but never rendered: such arguments are refused, as in K2's format.
* Reasoning that is None, empty or white space renders as an empty think channel and is dropped by
  normalisation; with ``thinking=False`` reasoning is not rendered at all. K2's other normalisation rules
  apply unchanged (``developer`` -> ``system``, names not rendered, text parts joined), and no text may
  contain K2's or K3's special-token strings.
* ``thinking_effort`` (``low`` / ``high`` / ``max``) adds the released encoder's note; it is off by
  default (the released tokenizer's ``apply_chat_template`` defaults to ``max``). ``tool_choice`` adds the
  released ``required`` / ``none`` notes after the conversation. Parsing skips these synthesised turns.

``parse_chat(render_chat(messages, add_generation_prompt=False)) == normalize_messages(messages)``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers

from k2lab.data.tokenizer import SPECIAL_TOKENS, XTML_TOKENS, Tokenizer
from k2lab.errors import K2LabError
from k2lab.runtime.chat import (
    ChatEncoding,
    ChatFormatError,
    ToolCallParseError,
    encode_pieces,
    markup_tokens,
    normalize_messages,
    refuse_reserved,
    split_special,
)
from k2lab.runtime.tool_spec import validate_tools

__all__ = [
    "K3_TOKENS",
    "close_tag",
    "encode_chat_k3",
    "generation_prompt",
    "normalize_messages_k3",
    "open_tag",
    "render_assistant_body_k3",
    "render_chat_k3",
    "with_k3_tokens",
    "xtml_type",
]

K3_TOKENS = XTML_TOKENS  # <|open|>, <|close|>, <|sep|>, <|end_of_msg|> (k2lab.data.tokenizer)
OPEN, CLOSE, SEP, END_OF_MSG = K3_TOKENS
RESERVED = (*SPECIAL_TOKENS, *K3_TOKENS)
THINKING_EFFORTS = ("low", "high", "max")
TOOL_CHOICE_NOTES = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}


def escape(value: object) -> str:
    """An attribute value: ``&`` -> ``&amp;`` first, then ``"`` -> ``&quot;``."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape(value: str) -> str:
    """Inverse of ``escape`` (``&quot;`` first, or the ``&`` of an escaped ``&quot;`` is undone twice)."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def open_tag(name: str, attrs: Sequence[tuple[str, object]] = ()) -> str:
    """``<|open|>name key="value" ...<|sep|>``."""
    return OPEN + name + "".join(f' {key}="{escape(value)}"' for key, value in attrs) + SEP


def close_tag(name: str) -> str:
    return f"{CLOSE}{name}{SEP}"


THINK_OPEN, THINK_CLOSE = open_tag("think"), close_tag("think")
RESPONSE_OPEN, RESPONSE_CLOSE = open_tag("response"), close_tag("response")
TOOLS_OPEN, TOOLS_CLOSE = open_tag("tools"), close_tag("tools")
CALL_CLOSE, ARGUMENT_CLOSE, MESSAGE_CLOSE = close_tag("call"), close_tag("argument"), close_tag("message")


def generation_prompt(thinking: bool = True) -> str:
    """The unclosed assistant turn the model continues: its think (or, thinking off, response) channel."""
    return open_tag("message", [("role", "assistant")]) + (THINK_OPEN if thinking else RESPONSE_OPEN)


def with_k3_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` with the K3 markup tokens it lacks appended as special tokens.

    They take the ids after the last one (``vocab_size``, ``vocab_size + 1``, ...): every id the tokenizer
    had stays what it was, so a K2-family tokenizer (and any model or data using it) is unchanged; a model
    serving the result needs ``vocab_size`` ≥ the new ``tokenizer.vocab_size``.
    """
    backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    missing = [token for token in K3_TOKENS if token not in tokenizer.special_tokens]
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in missing])
    return Tokenizer(backend, tokenizer.path)


# ------------------------------------------------------------------------------------------ normalisation


def xtml_type(value: object) -> str:
    """The ``type`` attribute of an argument value (bool before int: a bool is an int in Python)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def normalize_messages_k3(
    messages: Sequence[Mapping[str, Any]], thinking: bool = True
) -> list[dict[str, Any]]:
    """The messages as ``render_chat_k3`` writes them and ``parse_chat_k3`` reads them back (module doc).

    K2's normalisation (``k2lab.runtime.chat.normalize_messages``: checks, text parts, renumbered ids)
    followed by K3's: canonical arguments, reasoning rules, tool results in call order; raises
    ``ChatFormatError`` for anything K3's format cannot carry.
    """
    out = normalize_messages(messages)
    result: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []  # the latest assistant turn's calls
    index = 0
    while index < len(out):
        message = out[index]
        if message["role"] == "tool":
            run = [message]
            while index + len(run) < len(out) and out[index + len(run)]["role"] == "tool":
                run.append(out[index + len(run)])
            result += _ordered_results(run, calls, index)
            index, calls = index + len(run), []
            continue
        if message["role"] == "assistant":
            message = _assistant(message, thinking, f"messages[{index}]")
            calls = message.get("tool_calls", [])
        else:
            calls = []
        _check_reserved(message, f"messages[{index}]")
        result.append(message)
        index += 1
    return result


def _assistant(message: dict[str, Any], thinking: bool, where: str) -> dict[str, Any]:
    out = dict(message)
    reasoning = out.pop("reasoning_content", None)
    if thinking and reasoning is not None and reasoning.strip():
        out["reasoning_content"] = reasoning
    if out.get("tool_calls"):
        out["tool_calls"] = [_canonical_call(call) for call in out["tool_calls"]]
        for j, call in enumerate(out["tool_calls"]):
            _check_reserved(call["function"], f"{where}.tool_calls[{j}].function")
    return out


def _canonical_call(call: dict[str, Any]) -> dict[str, Any]:
    arguments = json.dumps(json.loads(call["function"]["arguments"]), ensure_ascii=False)
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _check_reserved(message: Mapping[str, Any], where: str) -> None:
    for key, value in message.items():
        if isinstance(value, str):
            refuse_reserved(value, f"{where}.{key}", RESERVED)


def _ordered_results(
    run: list[dict[str, Any]], calls: list[dict[str, Any]], start: int
) -> list[dict[str, Any]]:
    """A run of tool results in the order of the calls they answer (which must be calls 1..k, once each)."""
    position = {call["id"]: k for k, call in enumerate(calls)}
    for j, message in enumerate(run):
        where = f"messages[{start + j}]"
        if message["tool_call_id"] not in position:
            raise ChatFormatError(
                f"{where}.tool_call_id {message['tool_call_id']!r} answers no call of the assistant turn "
                "right before its tool results (K3 binds a result to that turn's calls by position)"
            )
        _check_reserved(message, where)
    ordered = sorted(run, key=lambda m: position[m["tool_call_id"]])
    answered = [position[m["tool_call_id"]] for m in ordered]
    if answered != list(range(len(run))):
        numbers = ", ".join(str(k + 1) for k in answered)
        raise ChatFormatError(
            f"messages[{start}:{start + len(run)}] answer calls {numbers}; K3 tool results must answer "
            f"calls 1..{len(run)} of the turn before them once each"
        )
    return ordered


# ------------------------------------------------------------------------------------------------ render


def render_chat_k3(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = None,
    tool_choice: object = None,
) -> str:
    """The conversation in K3's format (module doc): declarations, effort note, messages, choice note."""
    turns = [_turn([("role", "system"), ("type", "tool-declare")], tool_declaration(tools))] if tools else []
    if thinking and thinking_effort is not None:
        if thinking_effort not in THINKING_EFFORTS:
            raise ChatFormatError(
                f"thinking_effort must be one of {', '.join(THINKING_EFFORTS)}, got {thinking_effort!r}"
            )
        turns.append(_turn([("role", "system"), ("type", "thinking-effort")], _effort_note(thinking_effort)))
    calls: list[dict[str, Any]] = []
    index = 0
    for message in normalize_messages_k3(messages, thinking):
        role = message["role"]
        if role == "tool":
            index += 1
            name = calls[index - 1]["function"]["name"]
            turns.append(_turn([("role", "tool"), ("tool", name), ("index", index)], message["content"]))
            continue
        calls, index = message.get("tool_calls", []), 0
        body = render_assistant_body_k3(message, thinking) if role == "assistant" else message["content"]
        turns.append(_turn([("role", role)], body))
    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICE_NOTES:
        turns.append(_turn([("role", "system"), ("type", "tool-choice")], TOOL_CHOICE_NOTES[tool_choice]))
    if add_generation_prompt:
        turns.append(generation_prompt(thinking))
    return "".join(turns)


def _turn(attrs: Sequence[tuple[str, object]], body: str) -> str:
    return f"{open_tag('message', attrs)}{body}{MESSAGE_CLOSE}{END_OF_MSG}"


def _effort_note(effort: str) -> str:
    return (
        "`thinking_effort` guides on how much to think in your thinking channel (not including the "
        "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
        f"Now the system is invoked with `thinking_effort={effort}`."
    )


def _sorted_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    return [_sorted_keys(item) for item in value] if isinstance(value, list) else value


def tool_declaration(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool-declare turn's body: the validated tools as compact JSON, keys sorted at every depth."""
    compact = json.dumps(_sorted_keys(validate_tools(tools)), ensure_ascii=False, separators=(",", ":"))
    refuse_reserved(compact, "tools", RESERVED)  # a description could otherwise inject a turn
    return f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{compact}\n```"


def render_assistant_body_k3(message: Mapping[str, Any], thinking: bool = True) -> str:
    """``[think channel]`` + response channel + ``[tools channel]`` of a normalised assistant message."""
    body = f"{THINK_OPEN}{message.get('reasoning_content') or ''}{THINK_CLOSE}" if thinking else ""
    body += f"{RESPONSE_OPEN}{message.get('content') or ''}{RESPONSE_CLOSE}"
    calls = message.get("tool_calls") or []
    if calls:
        body += TOOLS_OPEN + "".join(_render_call(call, k + 1) for k, call in enumerate(calls)) + TOOLS_CLOSE
    return body


def _render_call(call: Mapping[str, Any], index: int) -> str:
    arguments = json.loads(call["function"]["arguments"])
    blocks = [
        open_tag("argument", [("key", key), ("type", xtml_type(value))])
        + (value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
        + ARGUMENT_CLOSE
        for key, value in arguments.items()
    ]
    return (
        open_tag("call", [("tool", call["function"]["name"]), ("index", index)])
        + "".join(blocks)
        + CALL_CLOSE
    )


# ------------------------------------------------------------------------------------------------ encode


def encode_chat_k3(
    tokenizer: Tokenizer,
    conversation: str | Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    thinking: bool = True,
) -> ChatEncoding:
    """Ids of a K3 conversation (messages are rendered first) and, per token, whether the assistant wrote it.

    The mask is True from the end of each assistant turn's generation prompt (``<|open|>message
    role="assistant"<|sep|>`` and the channel it opens) through its ``<|end_of_msg|>``: what the model
    produces after that prompt. The text is split at the format's markup tokens (``RESERVED``) only, as in
    ``encode_chat``: an imported tokenizer's other special-token strings in a message stay text.
    """
    text = (
        conversation
        if isinstance(conversation, str)
        else render_chat_k3(conversation, tools, add_generation_prompt, thinking)
    )
    markup = markup_tokens(tokenizer, RESERVED)
    missing = [token for token in K3_TOKENS if token not in markup]
    if missing:
        raise K2LabError(f"the tokenizer lacks K3's chat tokens {', '.join(missing)} (see with_k3_tokens)")
    prompt = generation_prompt(thinking)
    spans = []
    for start in (m.end() for m in re.finditer(re.escape(prompt), text)):
        end = text.find(END_OF_MSG, start)
        spans.append((start, len(text) if end < 0 else end + len(END_OF_MSG)))
    pieces, position = [], 0
    for piece in split_special(text, markup):
        pieces.append((piece, any(a <= position < b for a, b in spans)))
        position += len(piece)
    return encode_pieces(tokenizer, pieces, markup)


# ------------------------------------------------------------------------------------------- attributes

ATTRIBUTE = re.compile(r'\s+([A-Za-z_][\w-]*)="([^"]*)"')


def parse_header(header: str, name: str) -> dict[str, str] | None:
    """The attributes of an opening tag's text (between ``<|open|>`` and ``<|sep|>``) named ``name``,
    or None if it is another tag or does not parse as ``name( key="value")*``."""
    if not header.startswith(name):
        return None
    rest, attrs, position = header[len(name) :], {}, 0
    while position < len(rest):
        match = ATTRIBUTE.match(rest, position)
        if match is None:
            return None
        attrs[match.group(1)] = unescape(match.group(2))
        position = match.end()
    return attrs


def check_no_markup(text: str, where: str, problems: list[str]) -> None:
    """Record a problem when ``text`` (a channel's body) holds markup tokens."""
    stray = [token for token in K3_TOKENS if token in text]
    if stray:
        problems.append(f"{', '.join(stray)} inside the {where}")


def expect(text: str, position: int, literal: str) -> int | None:
    """Position after ``literal`` when ``text`` has it at ``position`` (else None)."""
    return position + len(literal) if text.startswith(literal, position) else None


def raise_if(problems: Sequence[str], where: str = "assistant turn") -> None:
    if problems:
        raise ToolCallParseError(problems, where)
