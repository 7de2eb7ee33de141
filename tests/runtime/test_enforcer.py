"""The tool-call decoding enforcer: a random-weights model forced to call tools always produces calls that
parse and validate against the declared JSON Schemas (over many seeds), and cannot open a call when told not to."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.runtime.enforcer import GrammarError, ToolCallGrammar, pack_token_mask, unpack_token_mask
from tests.conftest import randomize
from tests.runtime.test_budget import ISSUE as ISSUE_SCHEMA

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city", "unit"],
        },
    },
}
BOOKING = {
    "type": "function",
    "function": {
        "name": "book-table",
        "parameters": {
            "type": "object",
            "properties": {
                "guests": {"type": "array", "items": {"type": "object", "properties": {
                    "name": {"type": "string"}, "vegan": {"type": "boolean"}}, "required": ["name"]}},
                "budget": {"type": "number"},
                "note": {"type": ["string", "null"]},
                "slot": {"type": "object", "properties": {"day": {"enum": ["mon", "tue"]}, "hour": {"type": "integer"}},
                         "required": ["day", "hour"]},
            },
            "required": ["guests", "slot"],
        },
    },
}  # fmt: skip
TOOLS = [WEATHER, BOOKING]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL = re.compile(
    r"<\|tool_call_begin\|>functions\.(?P<name>[\w-]+):(?P<idx>\d+)<\|tool_call_argument_begin\|>"
    r"(?P<args>.*?)<\|tool_call_end\|>",
    re.S,
)


@pytest.fixture(scope="module")
def setup(small_tokenizer):
    model = randomize(build_model(load_preset("k2-nano", vocab_size=300)), seed=0)
    return small_tokenizer, model


class FinishingModel:
    """Wraps the enforcer: adds +3 to the random model's logits of closing tokens (any token with '"', '}'
    or ']' in it, the call and section ends) so it finishes within the budget, as a trained model would.
    The mask is applied after, so validity still rests on the enforcer alone."""

    def __init__(self, inner, tokenizer):
        self.inner = inner
        text = [tokenizer.decode([i]) for i in range(300)]
        self.closers = [i for i, t in enumerate(text) if any(c in t for c in '"}]')]
        self.closers += [
            tokenizer.special_tokens[t] for t in ("<|tool_call_end|>", "<|tool_calls_section_end|>")
        ]

    def mask(self, logits):
        logits[self.closers] += 3.0
        self.inner.mask(logits)

    def advance(self, token):
        self.inner.advance(token)


def calls_of(text: str) -> list[tuple[str, dict]]:
    body = text.split("<|tool_calls_section_begin|>", 1)[1].split("<|tool_calls_section_end|>", 1)[0]
    found = [(m["name"], json.loads(m["args"])) for m in CALL.finditer(body)]
    assert CALL.sub("", body) == "", f"stray text between calls: {body!r}"
    return found


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [("required", True), ({"type": "function", "function": {"name": "book-table"}}, False)],
)
def test_forced_calls_always_parse_and_validate(setup, tool_choice, parallel):
    tokenizer, model = setup
    grammar = ToolCallGrammar.build(tokenizer, 300, TOOLS, tool_choice, parallel_tool_calls=parallel)
    end = tokenizer.special_tokens["<|im_end|>"]
    counted = 0
    for seed in range(12):
        settings = GenerationConfig(max_new_tokens=400, temperature=1.0, seed=seed, eos_token_id=end)
        prompt = torch.randint(20, 290, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        (out,) = generate(
            model, [prompt], settings, constraints=[FinishingModel(grammar.constraint(), tokenizer)]
        )
        assert out[-1] == end, f"seed {seed}: did not finish in 400 tokens: {tokenizer.decode(out)!r}"
        text = tokenizer.decode(out)
        assert text.startswith("<|tool_calls_section_begin|>") and text.endswith(
            "<|tool_calls_section_end|><|im_end|>"
        )
        for name, arguments in calls_of(text):
            if isinstance(tool_choice, dict):
                assert name == "book-table"
            if not parallel:
                assert len(calls_of(text)) == 1
            jsonschema.validate(arguments, SCHEMAS[name])
            counted += 1
    assert counted >= 12


def test_sections_copy_the_grammar_start_and_never_share_it(setup):
    """Every section starts from a copy of one compiled matcher: advancing one constraint leaves the next
    one's masks those of a freshly compiled matcher."""
    tokenizer, _ = setup
    grammar = ToolCallGrammar.build(tokenizer, 300, TOOLS, "required")
    first = grammar.constraint()
    start = first.allowed_tokens().clone()
    for _ in range(5):  # walk the first one a few tokens into its call
        first.advance(int(first.allowed_tokens().nonzero()[0]))
    assert not torch.equal(first.allowed_tokens(), start)
    second = grammar.constraint()
    assert torch.equal(second.allowed_tokens(), start)
    fresh = ToolCallGrammar.build(tokenizer, 300, TOOLS, "required").constraint()
    assert torch.equal(fresh.allowed_tokens(), start)


def test_auto_and_none(setup):
    tokenizer, model = setup
    begin = tokenizer.special_tokens["<|tool_calls_section_begin|>"]
    none = ToolCallGrammar.build(tokenizer, 300, TOOLS, "none").constraint()
    logits = torch.zeros(300)
    none.mask(logits)
    assert logits[begin] == float("-inf") and torch.isfinite(logits[:begin]).all()
    auto = ToolCallGrammar.build(tokenizer, 300, TOOLS, "auto").constraint()
    logits = torch.zeros(300)
    auto.mask(logits)
    assert torch.isfinite(logits).all()  # free text until the model opens a section
    auto.advance(begin)
    logits = torch.zeros(300)
    auto.mask(logits)
    assert torch.isfinite(logits).sum() == 1  # only <|tool_call_begin|> may follow


def test_bad_tool_choice_is_a_clear_error(setup):
    tokenizer, _ = setup
    with pytest.raises(GrammarError, match="not among the tools"):
        ToolCallGrammar.build(tokenizer, 300, TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(GrammarError, match="required"):
        ToolCallGrammar.build(tokenizer, 300, [], "required")


def recursive(node: dict, optional: bool = False) -> dict:
    """A tool whose required ``a`` is ``node``, with ``#/$defs/n`` (node's reference to itself) in scope."""
    parameters = {"$defs": {"n": node}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}
    return {"type": "function", "function": {"name": "f", "parameters": {**parameters, "required": ["a"]}}}


REF = {"$ref": "#/$defs/n"}
UNENDING = {
    "object": {"type": "object", "properties": {"c": REF}, "required": ["c"]},
    "array": {"type": "array", "items": REF, "minItems": 1},
    "every branch": {"anyOf": [{"type": "object", "properties": {"c": REF}, "required": ["c"]}, {"allOf": [REF]}]},
    "the root": {"type": "object", "properties": {"r": {"$ref": "#"}}, "required": ["r"]},
}  # fmt: skip
ENDING = {
    "optional": {"type": "object", "properties": {"c": REF}},
    "no minItems": {"type": "array", "items": REF},
    "a way out": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"c": REF}, "required": ["c"]}]},
    "a nullable type": {"type": ["object", "null"], "properties": {"c": REF}, "required": ["c"]},
    "no type": {"properties": {"c": REF}, "required": ["c"]},
}  # fmt: skip


@pytest.mark.parametrize("shape", list(UNENDING))
def test_a_required_recursion_without_end_is_refused_at_build(setup, shape):
    """A schema whose every value holds itself again compiled, and a forced call ran until llguidance's
    fast-forward gave up mid-generation ("Too many items … ff_tokens": HTTP 500): it is refused at build,
    the error the server answers with 400. Recursions with a way out still build and close (the same
    required recursion's nullable, untyped or optional forms; an anyOf branch that ends)."""
    for choice in ("required", "auto"):
        with pytest.raises(GrammarError, match="admit no finite value: the required recursion through #"):
            ToolCallGrammar.build(setup[0], 300, [recursive(UNENDING[shape])], choice)
    for node in ENDING.values():
        grammar = ToolCallGrammar.build(setup[0], 300, [recursive(node)], "required")
        constraint = grammar.constraint()
        for token in grammar.shortest_call:
            constraint.mask(logits := torch.zeros(300))
            assert torch.isfinite(logits[token])
            constraint.advance(token)
        assert constraint.finished_section


def test_token_masks_pack_to_bits_and_back():
    """Bit b of byte i holds token 8i + b; a vocabulary that is not a multiple of 8 pads with zeros."""
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0, [0, 9]] = True
    mask[1, [3, 7, 8, 10]] = True
    packed = pack_token_mask(mask)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[1, 2], [8 + 128, 1 + 4]]
    assert torch.equal(unpack_token_mask(packed, 11), mask)
    generator = torch.Generator().manual_seed(0)
    big = torch.rand(5, 300, generator=generator) < 0.5
    assert torch.equal(unpack_token_mask(pack_token_mask(big), 300), big)


ISSUE = {"type": "function", "function": {"name": "get_weather", "parameters": ISSUE_SCHEMA}}


def test_random_model_forced_call_fits_any_budget_from_the_shortest(small_tokenizer):
    """Issue 22's scenario on a random model (whose flat logits run numbers on): a forced call at temperature
    1 parses and validates at max_tokens = its shortest form and 64, over 5 seeds (batched, one
    generator per row); one token short, no section closes."""
    tokenizer = small_tokenizer
    model = randomize(
        build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=512)), seed=0
    )
    grammar = ToolCallGrammar.build(
        tokenizer, 300, [ISSUE], {"type": "function", "function": {"name": "get_weather"}}
    )
    shortest, end = len(grammar.shortest_call), tokenizer.special_tokens["<|im_end|>"]
    prompt = torch.randint(20, 290, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    for max_tokens in (shortest - 1, shortest, 64):
        settings = GenerationConfig(max_new_tokens=max_tokens, temperature=1.0, eos_token_id=end)
        outs = generate(
            model, [prompt] * 5, settings, row_seeds=range(5),
            constraints=[grammar.constraint(max_tokens) for _ in range(5)],
        )  # fmt: skip
        for out in outs:
            text = tokenizer.decode(out)
            if max_tokens < shortest:
                assert "<|tool_calls_section_end|>" not in text
                continue
            ((name, arguments),) = calls_of(text)
            jsonschema.validate(arguments, ISSUE["function"]["parameters"])
