"""Budget steering: with adversarial logits (random, and a thumb on the scale for digits and against every
closing token) a forced call closes and validates against its original schema at every budget from its
shortest known form up; below it the section stays open. Random schemas (hypothesis) with bounds on
lengths, items and values."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k2lab.runtime.enforcer import ToolCallGrammar, ll_tokenizer

ISSUE = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Rome"]},
        "days": {"type": "integer"},
        "units": {"type": "array", "items": {"type": "boolean"}},
    },
    "required": ["city", "days", "units"],
}


def forced(tokenizer, schema: dict, parallel: bool = False) -> ToolCallGrammar:
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    return ToolCallGrammar.build(tokenizer, 300, tools, "required", parallel_tool_calls=parallel)


def adversary(tokenizer) -> torch.Tensor:
    """Logit bias [V]: +6 on tokens with a digit, −6 on tokens that close something."""
    bias = torch.zeros(300)
    for i in range(300):
        text = tokenizer.decode([i])
        bias[i] += 6.0 * any(c.isdigit() for c in text) - 6.0 * any(c in text for c in '"}],')
    for name in ("<|tool_call_end|>", "<|tool_calls_section_end|>"):
        bias[tokenizer.special_tokens[name]] = -6.0
    return bias


def drive(
    grammar: ToolCallGrammar, max_tokens: int, seed: int, bias: torch.Tensor, budget: bool = True
) -> list[int]:
    """Sample ``max_tokens`` tokens (temperature 1, logits 2·N(0, 1) + ``bias`` [V]) under the budgeted
    constraint, stopping at the section end."""
    constraint = grammar.constraint(max_tokens if budget else None)
    generator, tokens = torch.Generator().manual_seed(seed), []
    for _ in range(max_tokens):
        logits = torch.randn(bias.shape[0], generator=generator) * 2 + bias
        constraint.mask(logits)
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        constraint.advance(token)
        tokens.append(token)
        if constraint.finished_section:
            break
    return tokens


def arguments(tokenizer, tokens: list[int]) -> list[dict]:
    text = tokenizer.decode(tokens)
    assert text.endswith("<|tool_calls_section_end|>"), f"section not closed: {text!r}"
    pieces = text.split("<|tool_call_argument_begin|>")[1:]
    return [json.loads(piece.split("<|tool_call_end|>")[0]) for piece in pieces]


def test_shortest_call_is_no_longer_than_the_hand_written_minimum(small_tokenizer):
    """The minimal call, written by hand and tokenized canonically, is never shorter than the search's."""
    ll = ll_tokenizer(small_tokenizer, 300)
    special = small_tokenizer.special_tokens
    shortest = None
    for city in ("Paris", "Tokyo", "Rome"):
        body = '{"city": "' + city + '", "days": 0, "units": []}'
        tokens = [special["<|tool_calls_section_begin|>"], special["<|tool_call_begin|>"]]
        tokens += [*ll.tokenize_str("functions.f:0"), special["<|tool_call_argument_begin|>"]]
        tokens += [
            *ll.tokenize_str(body),
            special["<|tool_call_end|>"],
            special["<|tool_calls_section_end|>"],
        ]
        shortest = min(shortest or len(tokens), len(tokens))
    assert len(forced(small_tokenizer, ISSUE).shortest_call) <= shortest


def test_issue_schema_closes_at_every_budget_from_the_shortest(small_tokenizer):
    grammar, bias = forced(small_tokenizer, ISSUE), adversary(small_tokenizer)
    shortest = len(grammar.shortest_call)
    for max_tokens in (shortest, shortest + 1, shortest + 2, shortest + 8, 64, 128):
        for seed in range(6):
            tokens = drive(grammar, max_tokens, seed, bias)
            assert len(tokens) <= max_tokens
            (call,) = arguments(small_tokenizer, tokens)
            jsonschema.validate(call, ISSUE)
            assert abs(call["days"]) < 2**63
    for seed in range(3):  # one token short: the section cannot close
        text = small_tokenizer.decode(drive(grammar, shortest - 1, seed, bias))
        assert "<|tool_calls_section_end|>" not in text


STRINGS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "note": {"type": "string"}},
    "required": ["city", "note"],
}


def test_unbounded_strings_close_in_budget_once_open(small_tokenizer):
    """Strings without ``maxLength``, sampled with ``}`` and ``]`` favoured and ``"`` against: from inside an
    open string the shortest completion is a closing ``"``, not more ``}`` as content (the search took those,
    found no end, and the steering gave up: a forced call to a tool with one string argument ran on to
    max_tokens unclosed on the trained demo model, 6 of 8 times at 200 tokens)."""
    grammar = forced(small_tokenizer, STRINGS)
    bias = torch.zeros(300)
    for i in range(300):
        text = small_tokenizer.decode([i])
        bias[i] += 4.0 * any(c in text for c in "}]") - 4.0 * ('"' in text)
    shortest = len(grammar.shortest_call)
    for max_tokens in (shortest, shortest + 3, 40, 64):
        for seed in range(6):
            tokens = drive(grammar, max_tokens, seed, bias)
            assert len(tokens) <= max_tokens
            (call,) = arguments(small_tokenizer, tokens)
            jsonschema.validate(call, STRINGS)


def test_an_ample_budget_changes_nothing(small_tokenizer):
    """Far from the end the mask is the grammar's alone: the same samples as without a budget."""
    grammar, flat = forced(small_tokenizer, ISSUE), torch.zeros(300)
    for seed in range(6):
        free = drive(grammar, 400, seed, flat, budget=False)
        assert len(free) < 400 - 2 * len(grammar.shortest_call)
        assert drive(grammar, 400, seed, flat) == free


def test_parallel_calls_close_in_budget(small_tokenizer):
    grammar, bias = forced(small_tokenizer, ISSUE, parallel=True), adversary(small_tokenizer)
    shortest = len(grammar.shortest_call)
    for max_tokens in (shortest, shortest + 5, 2 * shortest + 3, 96):
        for seed in range(4):
            for call in arguments(small_tokenizer, drive(grammar, max_tokens, seed, bias)):
                jsonschema.validate(call, ISSUE)


def test_auto_opens_a_section_only_while_a_call_fits(small_tokenizer):
    tools = [{"type": "function", "function": {"name": "f", "parameters": ISSUE}}]
    grammar = ToolCallGrammar.build(small_tokenizer, 300, tools, "auto")
    begin, shortest = (
        small_tokenizer.special_tokens["<|tool_calls_section_begin|>"],
        len(grammar.shortest_call),
    )
    for max_tokens, allowed in ((shortest, True), (shortest - 1, False)):
        logits = torch.zeros(300)
        grammar.constraint(max_tokens).mask(logits)
        assert bool(torch.isfinite(logits[begin])) is allowed
        assert torch.isfinite(logits).sum() >= 299


def _value_schema() -> st.SearchStrategy[dict]:
    small = st.integers(-50, 50)
    integer = st.builds(
        lambda lo, span, exclusive: {"type": "integer", ("exclusiveMinimum" if exclusive else "minimum"): lo,
                                     "maximum": lo + span},
        small, st.integers(2, 10**6), st.booleans(),
    )  # fmt: skip
    number = st.builds(lambda lo: {"type": "number", "minimum": lo}, small) | st.just({"type": "number"})
    string = st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 4), st.integers(0, 6),
    )  # fmt: skip
    items = st.sampled_from([{"type": "boolean"}, {"type": "integer"}, {"enum": ["a", "bc"]}])
    array = st.builds(
        lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
        items, st.integers(0, 3), st.integers(0, 3),
    )  # fmt: skip
    return st.one_of(integer, number, string, array, st.just({"type": ["integer", "null"]}))


SCHEMAS = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d"]), _value_schema(), min_size=1, max_size=4
).flatmap(
    lambda props: st.builds(
        lambda required: {"type": "object", "properties": props, "required": required},
        st.lists(st.sampled_from(sorted(props)), unique=True),
    )
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, extra=st.sampled_from([0, 1, 3, 10, 40]), seed=st.integers(0, 2**16))
def test_random_schemas_close_and_validate(small_tokenizer, schema, extra, seed):
    grammar = forced(small_tokenizer, schema)
    tokens = drive(grammar, len(grammar.shortest_call) + extra, seed, adversary(small_tokenizer))
    (call,) = arguments(small_tokenizer, tokens)
    jsonschema.validate(call, schema)


@pytest.mark.parametrize("calls", [1, 2])
def test_a_tight_budget_keeps_only_the_witness_when_it_holds_the_mass(small_tokenizer, calls):
    """Steering starts once the budget left, less the token being chosen, no longer holds the shortest
    completion plus one more whole call; following the shortest completion from a budget of 1 or 2 shortest
    calls, that is every step. The allowed tokens are then the completion's next token (the witness) plus
    likely alternatives that still close, tested only until they hold ``STEER_MASS`` (0.95): a witness with
    a logit 30 above the rest holds it alone, so it is the only token left (other cities of the same length
    would close too)."""
    grammar = forced(small_tokenizer, ISSUE)
    constraint = grammar.constraint(calls * len(grammar.shortest_call))
    generator = torch.Generator().manual_seed(0)
    steered = 0
    while not constraint.finished_section:
        constraint.mask(torch.zeros(300))  # finds the shortest completion from here
        logits = torch.randn(300, generator=generator)
        if constraint.path:
            logits[constraint.path[0]] += 30.0
            steered += 1
        constraint.mask(logits)
        allowed = torch.isfinite(logits).nonzero()[:, 0].tolist()
        if constraint.path:
            assert allowed == [constraint.path[0]]
        constraint.advance(int(logits.argmax()))
    assert steered >= len(grammar.shortest_call) - 2
