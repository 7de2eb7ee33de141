"""Bounded numbers: the compiled grammar accepts int64 integers and short decimals, and nothing longer;
bounds a schema gives are kept (and tightened to int64), data keywords untouched."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher

from k2lab.runtime.enforcer import ToolCallGrammar, ll_tokenizer
from k2lab.runtime.schema_bounds import INT_MAX, INT_MIN, bounded_numbers


def tool(schema: dict) -> dict:
    properties = {"x": schema}
    parameters = {"type": "object", "properties": properties, "required": ["x"]}
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def accepts(tokenizer, schema: dict, value: str) -> bool:
    """Whether the enforcer's grammar for ``{"x": schema}`` accepts the call ``{"x": value}``."""
    grammar = ToolCallGrammar.build(tokenizer, 300, [tool(schema)], "required")
    ll, special = ll_tokenizer(tokenizer, 300), tokenizer.special_tokens
    tokens = [special["<|tool_calls_section_begin|>"], special["<|tool_call_begin|>"]]
    tokens += ll.tokenize_str("functions.f:0") + [special["<|tool_call_argument_begin|>"]]
    tokens += ll.tokenize_str('{"x": ' + value + "}")
    tokens += [special["<|tool_call_end|>"], special["<|tool_calls_section_end|>"]]
    matcher = LLMatcher(grammar.tokenizer, grammar.grammar)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize(
    ("schema", "value", "ok"),
    [
        ({"type": "integer"}, "9223372036854775807", True),  # 2^63 - 1: 19 digits
        ({"type": "integer"}, "9223372036854775808", False),
        ({"type": "integer"}, "12345678901234567890", False),  # 20 digits
        ({"type": "integer"}, str(INT_MIN), True),
        ({"type": "integer"}, str(INT_MIN - 1), False),
        ({"type": "integer"}, "-0", True),
        ({"type": "integer", "minimum": 3, "exclusiveMaximum": 7}, "6", True),
        ({"type": "integer", "minimum": 3, "exclusiveMaximum": 7}, "7", False),
        ({"type": "integer", "minimum": 3, "exclusiveMaximum": 7}, "2", False),
        ({"type": "integer", "minimum": -1e30}, str(INT_MIN - 1), False),  # tightened to int64
        ({"type": "number"}, "9223372036854775807", True),  # an integer-valued number: int64
        ({"type": "number"}, "99999999999.999999", True),  # 17 significant digits
        ({"type": "number"}, "99999999999.9999999", False),
        ({"type": "number"}, "100000000000.5", False),
        ({"type": "number"}, "0.000001", True),
        ({"type": "number"}, "1e5", False),
        ({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "0", False),
        ({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "0.25", True),
        ({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "1.5", False),
        ({"type": ["integer", "null"]}, "null", True),
        ({"type": ["integer", "null"]}, "123456789012345678901", False),
        ({"type": "string", "maxLength": 3}, '"abc"', True),
        ({"type": "string", "maxLength": 3}, '"abcd"', False),
        ({"type": "string", "minLength": 2}, '"a"', False),
        ({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "[true, false, true]", False),
        ({"type": "array", "items": {"type": "boolean"}, "minItems": 1}, "[]", False),
        ({"type": "array", "items": {"type": "boolean"}, "minItems": 1}, "[false]", True),
    ],
)
def test_compiled_bounds(small_tokenizer, schema, value, ok):
    assert accepts(small_tokenizer, schema, value) is ok


def test_rewrite_keeps_tighter_bounds_and_data():
    assert bounded_numbers({"type": "integer", "maximum": 5}) == {
        "type": "integer",
        "maximum": 5,
        "minimum": INT_MIN,
    }
    assert bounded_numbers({"type": "integer", "exclusiveMinimum": 2**70})["exclusiveMinimum"] == 2**70
    wide = bounded_numbers({"type": "integer", "minimum": -(2**70), "maximum": 2**70})
    assert (wide["minimum"], wide["maximum"]) == (INT_MIN, INT_MAX)
    stepped = bounded_numbers({"type": "number", "multipleOf": 0.5})
    assert stepped["multipleOf"] == 0.5 and "anyOf" not in stepped
    data = {"enum": [{"type": "integer"}], "default": {"type": "number"}}
    assert bounded_numbers(data) == data
    nested = bounded_numbers({"$defs": {"n": {"type": "integer"}}, "items": [{"type": "integer"}]})
    assert nested["$defs"]["n"]["maximum"] == INT_MAX and nested["items"][0]["minimum"] == INT_MIN
