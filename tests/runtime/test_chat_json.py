"""Tool-call arguments are strict JSON: ``NaN`` / ``Infinity`` (which Python's ``json`` reads, and a strict
parser such as JavaScript's ``JSON.parse`` rejects) are refused where K2's and K3's formats render or parse
arguments, with the error each gives for any other text that is not JSON."""

from __future__ import annotations

import pytest

from k2lab.runtime.chat import ChatFormatError, ToolCallParseError, parse_assistant, render_chat
from k2lab.runtime.chat_json import loads_strict
from k2lab.runtime.chat_k3 import K3_TOKENS, render_chat_k3
from k2lab.runtime.chat_k3_parse import parse_assistant_k3

O, C, S, _ = K3_TOKENS
NOT_JSON = ["NaN", "Infinity", "-Infinity", "1e999"]


def k3_turn(body: str) -> str:
    """A generated K3 turn with one call whose body is ``body``."""
    return f'{C}think{S}{O}response{S}{C}response{S}{O}tools{S}{O}call tool="f" index="1"{S}{body}{C}call{S}{C}tools{S}'


@pytest.mark.parametrize("number", NOT_JSON)
def test_loads_strict_refuses_what_strict_parsers_refuse(number):
    with pytest.raises(ValueError, match="NaN or Infinity|too large"):
        loads_strict(f'{{"a": {number}}}')
    assert loads_strict('{"a": 1e308, "b": -2, "c": [0.5]}') == {"a": 1e308, "b": -2, "c": [0.5]}


@pytest.mark.parametrize("number", NOT_JSON)
def test_rendering_refuses_non_json_numbers(number):
    for arguments in (f'{{"a": {number}}}', {"a": float(number)}):
        messages = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]},
        ]  # fmt: skip
        for render in (render_chat, render_chat_k3):
            with pytest.raises(ChatFormatError, match="not valid JSON"):
                render(messages)


@pytest.mark.parametrize("number", NOT_JSON)
def test_parsing_refuses_non_json_numbers(number):
    k2 = f'<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{{"a": {number}}}<|tool_call_end|><|tool_calls_section_end|>'  # fmt: skip
    with pytest.raises(ToolCallParseError, match="not valid JSON"):
        parse_assistant(k2)
    with pytest.raises(ToolCallParseError, match="not valid JSON"):
        parse_assistant_k3(k3_turn(f'{O}argument key="a" type="number"{S}{number}{C}argument{S}'))
    with pytest.raises(ToolCallParseError, match="not valid JSON"):
        parse_assistant_k3(k3_turn(f'{O}json type="object"{S}{{"a": [{number}]}}{C}json{S}'))
