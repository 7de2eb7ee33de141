"""Kimi K2's chat and tool-call format: render OpenAI-style messages to text, parse generated text back.

Format (MoonshotAI/Kimi-K2 ``docs/tool_call_guidance.md`` and the model's ``chat_template.jinja``); turns
follow each other with no separator::

    <|im_system|>tool_declare<|im_middle|>{declarations}<|im_end|>     (only with tools; always first)
    <|im_system|>system<|im_middle|>{content}<|im_end|>
    <|im_user|>user<|im_middle|>{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>[<think>{reasoning_content}</think>]{content}[{calls}]<|im_end|>
    <|im_system|>tool<|im_middle|>## Return of {tool_call_id}\\n{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>                               (generation prompt)

Tool calls of one assistant turn form one section after the content::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{arguments JSON}<|tool_call_end|>
    ...(one per call)
    <|tool_calls_section_end|>

(written without the line breaks shown). Decisions, where K2's template or guidance leaves room:

* ``idx`` is the call's index among all tool calls of the conversation, counted from 0 (K2 numbers them
  globally), and the OpenAI ``tool_call.id`` is ``functions.{name}:{idx}``. Rendering renumbers every
  call this way and rewrites the ``tool_call_id`` of the tool messages answering it, so clients' own
  ids (``call_abc``) work; a ``tool_call_id`` that answers no earlier call is kept as it is.
* Tool results use the system marker with the name ``tool`` and start with ``## Return of {id}\\n``, as
  K2's template renders them; the message's ``name`` is not rendered (and so not parsed back).
* Thinking (K2 Thinking): ``reasoning_content`` is rendered as ``<think>{reasoning}</think>`` right
  after ``<|im_middle|>``, before the content and the tool calls, in EVERY assistant turn that has it:
  thinking is carried back in full in later turns (interleaved with tool calls and results), never
  stripped. A turn without ``reasoning_content`` (or with None) has no ``<think>`` tags at all; an empty
  string renders ``<think></think>``. The generation prompt does not open a ``<think>``.
* Tool declarations are a ``tool_declare`` system turn before everything else (K2's template), written
  as TypeScript (default) or compact JSON by ``k2lab.runtime.tool_spec``.
* No default system prompt is inserted (K2's template adds one when the first message is not a system
  message); ``developer`` messages render as ``system``.
* Text may not contain the tokenizer's special-token strings (``<|im_end|>``, ...), reasoning may not
  contain ``</think>``, and assistant content without reasoning may not start with ``<think>``: such
  messages raise ``ChatFormatError`` instead of rendering text that would parse differently.
* Arguments are strict JSON (``k2lab.runtime.chat_json.loads_strict``): ``NaN``, ``Infinity`` and numbers
  overflowing a double are refused, rendering and parsing, as any other text that is not JSON.

``parse_chat(render_chat(messages, add_generation_prompt=False)) == normalize_messages(messages)``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from k2lab.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from k2lab.errors import K2LabError
from k2lab.runtime.chat_json import loads_strict
from k2lab.runtime.tool_spec import TOOL_NAME_PATTERN, render_tool_declaration

__all__ = [
    "GENERATION_PROMPT",
    "ChatEncoding",
    "ChatFormatError",
    "ToolCallParseError",
    "encode_chat",
    "normalize_messages",
    "parse_assistant",
    "parse_chat",
    "render_assistant_body",
    "render_chat",
    "tool_call_id",
]

IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
THINK_BEGIN, THINK_END = "<think>", "</think>"
# The strings K2's chat format writes as markup: encode_chat encodes these (where the tokenizer has them as
# special tokens) as special ids, and any other text as text.
MARKUP = (*SPECIAL_TOKENS, THINK_BEGIN, THINK_END)
GENERATION_PROMPT = f"{IM_ASSISTANT}assistant{IM_MIDDLE}"
RETURN_PREFIX = "## Return of "
TOOL_DECLARE = "tool_declare"
CALL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
CALL_ID_PATTERN = re.compile(r"functions\.([a-zA-Z0-9_-]{1,64}):(\d+)")
HEADER_PATTERN = re.compile(r"(<\|im_system\|>|<\|im_user\|>|<\|im_assistant\|>)([^<\n]*)<\|im_middle\|>")
ROLES = ("system", "developer", "user", "assistant", "tool")
IMAGE_PARTS = ("image_url", "input_image", "image")  # OpenAI chat / responses, Anthropic: refused by name


class ChatFormatError(K2LabError):
    """Messages (or tool calls in them) that cannot be rendered in K2's format."""


class ToolCallParseError(K2LabError):
    """Generated or rendered text that does not parse; ``problems`` lists everything found wrong."""

    def __init__(self, problems: Sequence[str], where: str = "assistant turn"):
        self.problems = list(problems)
        super().__init__(f"malformed {where}: " + "; ".join(self.problems))


def tool_call_id(name: str, index: int) -> str:
    """K2's id of the conversation's ``index``-th tool call: ``functions.{name}:{index}``."""
    return f"functions.{name}:{index}"


# ------------------------------------------------------------------------------------------ normalisation


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as ``render_chat`` writes them and ``parse_chat`` reads them back.

    Each becomes ``{"role", "content"}`` (text parts joined; ``developer`` -> ``system``), assistant
    messages add ``reasoning_content`` (when not None) and ``tool_calls`` (when non-empty; content is
    then None if empty), tool messages are ``{"role", "tool_call_id", "content"}``. Tool calls are
    renumbered ``functions.{name}:{idx}`` with idx global, arguments are JSON-object strings (a dict is
    dumped with ``json.dumps(..., ensure_ascii=False)``), and tool messages follow the renumbering.
    Raises ``ChatFormatError`` for anything that cannot be rendered.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatFormatError(f"messages must be a list of message objects, got {type(messages).__name__}")
    ids = _Renumbering()
    out = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ChatFormatError(f"{where} must be an object with a role, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        if role == "assistant":
            out.append(_normalize_assistant(message, where, ids))
        elif role == "tool":
            out.append(_normalize_tool(message, where, ids))
        else:
            role = "system" if role == "developer" else role
            out.append({"role": role, "content": _text(message.get("content"), f"{where}.content")})
    return out


@dataclass
class _Renumbering:
    """Tool calls seen so far and the K2 id each client id was renumbered to (a later call wins)."""

    count: int = 0
    renamed: dict[str, str] = field(default_factory=dict)


def _text(content: object, where: str, allow_none: bool = False) -> str:
    """String content (text parts joined), checked for reserved special-token strings."""
    if content is None and allow_none:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
                raise ChatFormatError(
                    f"{where}[{j}] is an image: image inputs are not supported by k2lab serve "
                    "(text parts only)"
                )
            if not (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise ChatFormatError(f"{where}[{j}] must be a text part {{'type': 'text', 'text': str}}")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise ChatFormatError(
            f"{where} must be a string or a list of text parts, got {type(content).__name__}"
        )
    refuse_reserved(content, where)
    return content


def refuse_reserved(text: str, where: str, reserved: Sequence[str] = SPECIAL_TOKENS) -> None:
    """``ChatFormatError`` when ``text`` holds one of the ``reserved`` special-token strings: encoded with the
    chat's markup, it would become the special token itself (an injected turn end or tool call)."""
    for token in reserved:
        if token in text:
            raise ChatFormatError(f"{where} contains the reserved special-token string {token}")


def _normalize_assistant(message: Mapping[str, Any], where: str, ids: _Renumbering) -> dict[str, Any]:
    content = _text(message.get("content"), f"{where}.content", allow_none=True)
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        reasoning = _text(reasoning, f"{where}.reasoning_content")
        if THINK_END in reasoning:
            raise ChatFormatError(f"{where}.reasoning_content contains {THINK_END}, which would end it early")
    elif content.startswith(THINK_BEGIN):
        raise ChatFormatError(
            f"{where}.content starts with {THINK_BEGIN} but the message has no reasoning_content"
        )
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}.tool_calls must be a list, got {type(calls).__name__}")
    out: dict[str, Any] = {"role": "assistant", "content": None if calls and not content else content}
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = [
            _normalize_call(call, f"{where}.tool_calls[{j}]", ids) for j, call in enumerate(calls)
        ]
    return out


def _normalize_call(call: object, where: str, ids: _Renumbering) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or call.get("type", "function") != "function":
        raise ChatFormatError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.match(name):
        raise ChatFormatError(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}")
    arguments = _arguments(function.get("arguments"), f"{where}.function.arguments")
    new_id = tool_call_id(name, ids.count)
    ids.count += 1
    old_id = call.get("id")
    ids.renamed[old_id if isinstance(old_id, str) and old_id else new_id] = new_id
    return {"id": new_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments(arguments: object, where: str) -> str:
    """The arguments as a JSON-object string (a string is kept verbatim after checking it)."""
    if arguments is None:
        arguments = "{}"
    if isinstance(arguments, Mapping):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ChatFormatError(f"{where} must be a JSON object string, got {type(arguments).__name__}")
    try:
        value = loads_strict(arguments)
    except (ValueError, RecursionError) as error:
        raise ChatFormatError(f"{where} is not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise ChatFormatError(f"{where} must be a JSON object, got {type(value).__name__}")
    return _text(arguments, where)


def _normalize_tool(message: Mapping[str, Any], where: str, ids: _Renumbering) -> dict[str, Any]:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id or "\n" in call_id:
        raise ChatFormatError(f"{where}.tool_call_id must be a non-empty one-line string, got {call_id!r}")
    call_id = ids.renamed.get(call_id) or _text(call_id, f"{where}.tool_call_id")
    return {
        "role": "tool",
        "tool_call_id": call_id,
        "content": _text(message.get("content"), f"{where}.content"),
    }


# ------------------------------------------------------------------------------------------------ render


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_format: str = "typescript",
    add_generation_prompt: bool = True,
) -> str:
    """The conversation in K2's format (see the module docstring), tool declarations first when given."""
    turns = [_turn(IM_SYSTEM, TOOL_DECLARE, _declaration(tools, tool_format))] if tools else []
    turns += [_render_message(message) for message in normalize_messages(messages)]
    if add_generation_prompt:
        turns.append(GENERATION_PROMPT)
    return "".join(turns)


def _declaration(tools: Sequence[Mapping[str, Any]], tool_format: str) -> str:
    """The tool-declare turn's body, refused when a name, description or schema holds a special-token string
    (a description with ``<|im_end|><|im_user|>`` injected a user turn)."""
    declaration = render_tool_declaration(tools, tool_format)
    refuse_reserved(declaration, "tools")
    return declaration


def _turn(marker: str, name: str, body: str) -> str:
    return f"{marker}{name}{IM_MIDDLE}{body}{IM_END}"


def _render_message(message: Mapping[str, Any]) -> str:
    role = message["role"]
    if role == "tool":
        return _turn(IM_SYSTEM, "tool", f"{RETURN_PREFIX}{message['tool_call_id']}\n{message['content']}")
    if role == "assistant":
        return _turn(IM_ASSISTANT, "assistant", render_assistant_body(message))
    return _turn(IM_SYSTEM if role == "system" else IM_USER, role, message["content"])


def render_assistant_body(message: Mapping[str, Any]) -> str:
    """``[<think>{reasoning}</think>]{content}[section]`` of a normalised assistant message."""
    reasoning = message.get("reasoning_content")
    think = "" if reasoning is None else f"{THINK_BEGIN}{reasoning}{THINK_END}"
    calls = message.get("tool_calls") or []
    section = "".join(
        f"{CALL_BEGIN}{call['id']}{ARGUMENT_BEGIN}{call['function']['arguments']}{CALL_END}" for call in calls
    )
    return (
        think + (message.get("content") or "") + (f"{SECTION_BEGIN}{section}{SECTION_END}" if calls else "")
    )


# ------------------------------------------------------------------------------------------------- parse


def parse_assistant(text: str) -> dict[str, Any]:
    """An OpenAI assistant message from a generated turn (the text after the generation prompt).

    A trailing ``<|im_end|>`` is optional. Returns ``{"role": "assistant", "content", ...}`` with
    ``reasoning_content`` when the turn opens with ``<think>`` and ``tool_calls`` (``[{id, type,
    function: {name, arguments}}]``, arguments the JSON text as generated) when it has a section;
    content is None when empty and there are tool calls. Raises ``ToolCallParseError`` listing every
    problem (unterminated thinking, stray or unbalanced markers, bad ids, arguments that are not a JSON
    object, text after the section).
    """
    if not isinstance(text, str):
        raise ToolCallParseError([f"expected a string, got {type(text).__name__}"])
    body = text[: -len(IM_END)] if text.endswith(IM_END) else text
    problems = [f"{IM_END} inside the turn"] if IM_END in body else []
    reasoning = None
    if body.startswith(THINK_BEGIN):
        close = body.find(THINK_END)
        if close < 0:
            raise ToolCallParseError([*problems, f"{THINK_BEGIN} is never closed by {THINK_END}"])
        reasoning, body = body[len(THINK_BEGIN) : close], body[close + len(THINK_END) :]
    content, calls = _split_calls(body, problems)
    if problems:
        raise ToolCallParseError(problems)
    message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content else content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _split_calls(body: str, problems: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Content before the tool-calls section and the parsed calls; problems are appended."""
    begin = body.find(SECTION_BEGIN)
    if begin < 0:
        stray = [marker for marker in CALL_MARKERS if marker in body]
        if stray:
            problems.append(f"{', '.join(stray)} outside a {SECTION_BEGIN} ... {SECTION_END} section")
        return body, []
    content, rest = body[:begin], body[begin + len(SECTION_BEGIN) :]
    stray = [marker for marker in CALL_MARKERS if marker in content]
    if stray:
        problems.append(f"{', '.join(stray)} before {SECTION_BEGIN}")
    end = rest.find(SECTION_END)
    if end < 0:
        problems.append(f"{SECTION_BEGIN} is never closed by {SECTION_END}")
        section, tail = rest, ""
    else:
        section, tail = rest[:end], rest[end + len(SECTION_END) :]
    if tail.strip():
        problems.append(f"text after {SECTION_END}: {_preview(tail)}")
    return content, _parse_section(section, problems)


def _parse_section(section: str, problems: list[str]) -> list[dict[str, Any]]:
    """Calls ``<|tool_call_begin|>id<|tool_call_argument_begin|>json<|tool_call_end|>``, whitespace between."""
    calls: list[dict[str, Any]] = []
    position, number = 0, 0
    while section[position:].strip():
        number += 1
        where = f"tool call {number}"
        start = len(section) - len(section[position:].lstrip())
        if not section.startswith(CALL_BEGIN, start):
            problems.append(f"{where}: expected {CALL_BEGIN}, found {_preview(section[start:])}")
            return calls
        close = section.find(CALL_END, start)
        if close < 0:
            problems.append(f"{where}: {CALL_BEGIN} is never closed by {CALL_END}")
            close = len(section)
        call = _parse_call(section[start + len(CALL_BEGIN) : close], where, problems)
        if call is not None:
            calls.append(call)
        position = close + len(CALL_END)
    if number == 0:
        problems.append("the tool-calls section holds no calls")
    return calls


def _parse_call(inner: str, where: str, problems: list[str]) -> dict[str, Any] | None:
    """One call from ``functions.{name}:{idx}<|tool_call_argument_begin|>{json}``; None on problems."""
    count = len(problems)
    stray = [marker for marker in (SECTION_BEGIN, SECTION_END, CALL_BEGIN) if marker in inner]
    if stray:
        problems.append(f"{where}: {', '.join(stray)} inside the call")
    if inner.count(ARGUMENT_BEGIN) != 1:
        problems.append(
            f"{where}: expected exactly one {ARGUMENT_BEGIN}, found {inner.count(ARGUMENT_BEGIN)}"
        )
        return None
    call_id, arguments = inner.split(ARGUMENT_BEGIN)
    call_id = call_id.strip()
    match = CALL_ID_PATTERN.fullmatch(call_id)
    if match is None:
        problems.append(f"{where}: id {_preview(call_id)} is not functions.NAME:INDEX")
    try:
        value = loads_strict(arguments)
        if not isinstance(value, dict):
            problems.append(f"{where}: arguments must be a JSON object, got {type(value).__name__}")
    except (ValueError, RecursionError) as error:
        problems.append(f"{where}: arguments are not valid JSON ({error}): {_preview(arguments)}")
    if len(problems) > count or match is None:
        return None
    return {"id": call_id, "type": "function", "function": {"name": match.group(1), "arguments": arguments}}


def _preview(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_chat(text: str) -> list[dict[str, Any]]:
    """The messages of a rendered conversation, as ``normalize_messages`` writes them.

    The ``tool_declare`` turn is skipped; a trailing generation prompt with nothing after it is
    ignored, and an unterminated last assistant turn is parsed as far as it goes. Raises
    ``ToolCallParseError`` for text outside turns, unknown turn names, unterminated turns and bad
    assistant or tool turns.
    """
    if not isinstance(text, str):
        raise ToolCallParseError([f"expected a string, got {type(text).__name__}"], "conversation")
    messages: list[dict[str, Any]] = []
    position = 0
    while position < len(text):
        header = HEADER_PATTERN.match(text, position)
        if header is None:
            found = _preview(text[position:])
            problem = f"at character {position}: expected <|im_...|>ROLE<|im_middle|>, found {found}"
            raise ToolCallParseError([problem], "conversation")
        marker, name = header.groups()
        end = text.find(IM_END, header.end())
        if end < 0 and marker != IM_ASSISTANT:
            raise ToolCallParseError(
                [f"turn {len(messages) + 1} ({name}) is never closed by {IM_END}"], "conversation"
            )
        body = text[header.end() : end if end >= 0 else len(text)]
        message = _parse_turn(marker, name, body, len(messages) + 1)
        if message is not None and (end >= 0 or body):
            messages.append(message)
        position = len(text) if end < 0 else end + len(IM_END)
    return messages


def _parse_turn(marker: str, name: str, body: str, number: int) -> dict[str, Any] | None:
    """One turn's message (None for ``tool_declare``)."""
    where = f"turn {number} ({name})"
    if marker == IM_ASSISTANT and name == "assistant":
        try:
            return parse_assistant(body)
        except ToolCallParseError as error:
            raise ToolCallParseError([f"{where}: {p}" for p in error.problems], "conversation") from None
    if marker == IM_USER and name == "user":
        return {"role": "user", "content": body}
    if marker == IM_SYSTEM and name in ("system", TOOL_DECLARE):
        return {"role": "system", "content": body} if name == "system" else None
    if marker == IM_SYSTEM and name == "tool":
        head, newline, content = body.partition("\n")
        if not head.startswith(RETURN_PREFIX) or not newline or head == RETURN_PREFIX:
            raise ToolCallParseError([f"{where}: does not start with '{RETURN_PREFIX}ID\\n'"], "conversation")
        return {"role": "tool", "tool_call_id": head[len(RETURN_PREFIX) :], "content": content}
    raise ToolCallParseError([f"{where}: unknown turn name {name!r} after {marker}"], "conversation")


# ------------------------------------------------------------------------------------------------ encode


@dataclass
class ChatEncoding:
    """Token ids of a conversation and, per token, whether the assistant produced it (SFT loss mask)."""

    ids: list[int]
    assistant_mask: list[bool]


def encode_chat(
    tokenizer: Tokenizer,
    conversation: str | Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_format: str = "typescript",
    add_generation_prompt: bool = False,
) -> ChatEncoding:
    """Encode a rendered conversation (or messages, rendered first) with special tokens recognised.

    The mask is True for the tokens of each assistant turn's body (thinking, content, tool-call section)
    and its closing ``<|im_end|>``; False for headers (``<|im_assistant|>assistant<|im_middle|>``), other
    turns and the generation prompt. The text is split at the chat format's markup tokens (``MARKUP``), each
    encoded as its special id, and the rest is encoded as text: for K2lab's own tokenizers the ids equal
    ``tokenizer.encode(text)``; an imported tokenizer's other special tokens (reserved ids) written in a
    message stay text instead of becoming those ids. Messages are rendered without a generation prompt by
    default (training data).
    """
    text = (
        conversation
        if isinstance(conversation, str)
        else render_chat(conversation, tools, tool_format, add_generation_prompt)
    )
    special = tokenizer.special_tokens
    missing = [
        token for token in (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END) if token not in special
    ]
    if missing:
        raise K2LabError(f"the tokenizer lacks K2's chat tokens {', '.join(missing)}")
    markup = markup_tokens(tokenizer, MARKUP)
    return encode_pieces(tokenizer, list(_pieces(text, markup)), markup)


def markup_tokens(tokenizer: Tokenizer, markup: Iterable[str]) -> dict[str, int]:
    """The ids of the tokenizer's special tokens among ``markup`` (the strings a chat format writes as
    markup): only these are encoded as special ids, so a special-token string of an imported tokenizer
    that no format writes (e.g. a reserved token) stays text when a message holds it."""
    special = tokenizer.special_tokens
    return {token: special[token] for token in markup if token in special}


def encode_markup_text(tokenizer: Tokenizer, text: str, markup: Iterable[str]) -> list[int]:
    """Ids of rendered chat ``text``: the tokenizer's special tokens among ``markup`` (a format's markup
    strings) as their ids, everything else as text, so a reserved special-token string of an imported
    tokenizer written in a message stays text (``encode_chat``'s rule, without the assistant mask; the
    same ids as ``tokenizer.encode(text)`` for k2lab's own tokenizers)."""
    found = markup_tokens(tokenizer, markup)
    if not found:
        return tokenizer.encode(text, allow_special=False)
    return encode_pieces(tokenizer, [(piece, False) for piece in split_special(text, found)], found).ids


def encode_pieces(
    tokenizer: Tokenizer, pieces: Sequence[tuple[str, bool]], markup: Mapping[str, int]
) -> ChatEncoding:
    """Ids of text pieces (each a ``markup`` token or plain text, as ``split_special`` cuts them) and each
    piece's mask flag repeated over its ids; plain text is encoded with special tokens off."""
    texts = iter(tokenizer.encode_batch([p for p, _ in pieces if p not in markup], allow_special=False))
    ids: list[int] = []
    mask: list[bool] = []
    for piece, flag in pieces:
        piece_ids = [markup[piece]] if piece in markup else next(texts)
        ids += piece_ids
        mask += [flag] * len(piece_ids)
    return ChatEncoding(ids, mask)


def split_special(text: str, special: Iterable[str]) -> list[str]:
    """``text`` cut at the special-token strings (kept as pieces of their own), empty pieces left out."""
    pattern = re.compile("(" + "|".join(re.escape(t) for t in sorted(special, key=len, reverse=True)) + ")")
    return [piece for piece in pattern.split(text) if piece]


def _pieces(text: str, markup: Mapping[str, int]) -> Iterable[tuple[str, bool]]:
    """Text split at markup tokens, each piece with whether it belongs to an assistant turn's body."""
    header, in_assistant = False, False  # header: between <|im_assistant|> and <|im_middle|>
    for piece in split_special(text, markup):
        if piece == IM_ASSISTANT:
            header = True
        elif piece == IM_MIDDLE and header:
            header, in_assistant = False, True
            yield piece, False
            continue
        elif piece in (IM_SYSTEM, IM_USER):
            header, in_assistant = False, False
        yield piece, in_assistant
        if piece == IM_END:
            in_assistant = False
