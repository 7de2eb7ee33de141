"""The decoding enforcer over K3's XTML tools channel: forced and named calls from a random model parse (K3's
parser) and validate against their schemas over many seeds, bounds hold on raw strings and numbers, the budget
steers a call shut from its shortest form up, and "none" / "auto" treat the multi-token trigger right."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.runtime.chat_format import K3ChatFormat
from k2lab.runtime.chat_k3 import CLOSE, OPEN, SEP, with_k3_tokens
from k2lab.runtime.enforcer import GrammarError, ToolCallGrammar
from k2lab.runtime.tool_grammar_k3 import tools_channel_lark
from tests.conftest import randomize
from tests.runtime.test_budget import ISSUE
from tests.runtime.test_budget import drive as budget_drive
from tests.runtime.test_enforcer import SCHEMAS, TOOLS

V = 320
BOUNDED = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 2, "maxLength": 6},
                "code": {"type": "string", "pattern": "^[a-c]{3}$"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 20},
                "score": {"type": "number", "exclusiveMaximum": 1, "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
            },
            "required": ["query", "code", "limit"],
        },
    },
}
SCHEMAS = {**SCHEMAS, "search": BOUNDED["function"]["parameters"], "f": ISSUE}


@pytest.fixture(scope="module")
def setup(small_tokenizer):
    tokenizer = with_k3_tokens(small_tokenizer)
    model = randomize(build_model(load_preset("k2-nano", vocab_size=V, max_position_embeddings=512)), seed=0)
    return tokenizer, model


class Finishing:
    """+3 on closing tokens (``<|close|>`` and any with '"', '}' or ']') so a random model finishes, as a trained
    one would; the enforcer's mask comes after, so validity rests on it alone."""

    def __init__(self, inner, tokenizer):
        self.inner = inner
        self.closers = [
            i for i in range(tokenizer.vocab_size) if any(c in tokenizer.decode([i]) for c in '"}]')
        ]
        self.closers.append(tokenizer.special_tokens[CLOSE])

    def mask(self, logits):
        logits[self.closers] += 3.0
        self.inner.mask(logits)

    def advance(self, token):
        self.inner.advance(token)


def check_calls(text: str, fmt: K3ChatFormat, only: str | None = None, single: bool = False) -> int:
    message = fmt.parse_assistant(text)
    calls = message["tool_calls"]
    assert (
        message["content"] is None and "reasoning_content" not in message and (len(calls) == 1 or not single)
    )
    for c in calls:
        assert only is None or c["function"]["name"] == only
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    return len(calls)


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "thinking"),
    [("required", True, True), ({"type": "function", "function": {"name": "book-table"}}, False, False)],
)
def test_forced_calls_parse_and_validate(setup, tool_choice, parallel, thinking):
    tokenizer, model = setup
    fmt = K3ChatFormat(thinking=thinking)
    grammar = ToolCallGrammar.build(tokenizer, V, [*TOOLS, BOUNDED], tool_choice, parallel, fmt.markup)
    end = tokenizer.special_tokens["<|end_of_msg|>"]
    counted = 0
    for seed in range(4):
        settings = GenerationConfig(max_new_tokens=300, temperature=1.0, seed=seed, eos_token_id=end)
        prompt = torch.randint(20, 290, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        (out,) = generate(model, [prompt], settings, constraints=[Finishing(grammar.constraint(), tokenizer)])
        assert out[-1] == end, f"seed {seed}: did not finish: {tokenizer.decode(out)!r}"
        text = tokenizer.decode(out)
        opener = f"{CLOSE}think{SEP}{OPEN}response{SEP}" if thinking else f"{CLOSE}response{SEP}"
        assert text.startswith(opener) and text.endswith(
            f"{CLOSE}tools{SEP}{CLOSE}message{SEP}<|end_of_msg|>"
        )
        only = None if isinstance(tool_choice, str) else "book-table"
        counted += check_calls(text, fmt, only, single=not parallel)
    assert counted >= 4


def drive(grammar: ToolCallGrammar, max_tokens: int, seed: int) -> list[int]:
    """Random logits (−6 on the closer) under the budgeted constraint, up to the section's end."""
    bias = torch.zeros(V)
    bias[grammar.closers[0]] = -6.0
    return budget_drive(grammar, max_tokens, seed, bias)


@pytest.mark.parametrize(
    "tool", [BOUNDED, {"type": "function", "function": {"name": "f", "parameters": ISSUE}}]
)
def test_budget_steers_to_a_valid_close(setup, tool):
    """At max_tokens = the shortest known form and a little more, adversarial random logits still close a
    valid call; one token fewer, the section cannot close."""
    tokenizer, _ = setup
    fmt = K3ChatFormat()
    grammar = ToolCallGrammar.build(tokenizer, V, [tool], "required", False, fmt.markup)
    shortest = len(grammar.shortest_call)
    for budget in (shortest, shortest + 5, shortest + 40):
        for seed in range(3):
            text = tokenizer.decode(drive(grammar, budget, seed))
            assert text.endswith(f"{CLOSE}message{SEP}"), (budget, seed, text)
            check_calls(text, fmt)
    assert not tokenizer.decode(drive(grammar, shortest - 1, 0)).endswith(f"{CLOSE}message{SEP}")


def test_none_and_auto_follow_the_multi_token_trigger(setup):
    tokenizer, _ = setup
    fmt = K3ChatFormat()
    trigger = tokenizer.encode(f"{OPEN}tools{SEP}")
    sep = tokenizer.special_tokens[SEP]
    none = ToolCallGrammar.build(tokenizer, V, TOOLS, "none", markup=fmt.markup).constraint()
    assert none.allowed_tokens() is None
    for token in trigger[:-1]:
        none.advance(token)
    allowed = none.allowed_tokens()
    assert not allowed[sep] and allowed.sum() == V - 1
    auto = ToolCallGrammar.build(tokenizer, V, TOOLS, "auto", markup=fmt.markup).constraint()
    for token in tokenizer.encode(f"hi{CLOSE}response{SEP}") + trigger:
        assert not auto.in_call
        auto.advance(token)
    assert auto.in_call
    allowed = auto.allowed_tokens()
    assert allowed[tokenizer.special_tokens[OPEN]] and allowed.sum() == 1  # a call must open
    grammar = ToolCallGrammar.build(tokenizer, V, TOOLS, "auto", markup=fmt.markup)
    short = grammar.constraint(max_tokens=len(grammar.shortest_call) - 1)  # a whole call no longer fits
    for token in trigger[:-1]:
        logits = torch.zeros(V)
        short.mask(logits)
        assert torch.isfinite(logits).all()  # free text until the trigger's last token
        short.advance(token)
    logits = torch.zeros(V)
    short.mask(logits)
    assert logits[sep] == float("-inf") and torch.isfinite(logits).sum() == V - 1


def test_auto_keeps_the_trigger_while_a_whole_call_still_fits(setup):
    """``shortest_call`` counts the whole trigger: at max_tokens = its length, the trigger's first tokens
    sampled, its last token (and the shortest call after it) still fits exactly, so nothing is masked."""
    tokenizer, _ = setup
    fmt = K3ChatFormat()
    trigger = tokenizer.encode(f"{OPEN}tools{SEP}")
    assert len(trigger) > 1
    grammar = ToolCallGrammar.build(tokenizer, V, TOOLS, "auto", markup=fmt.markup)
    exact = grammar.constraint(max_tokens=len(grammar.shortest_call))
    for token in trigger:
        logits = torch.zeros(V)
        exact.mask(logits)
        assert torch.isfinite(logits).all()
        exact.advance(token)
    assert exact.in_call


def test_the_trigger_is_read_as_text_whatever_pieces_spell_it(setup):
    """``tools`` spelled one byte per token (not the tokenizer's own encoding) still opens the tools channel:
    "none" masks the <|sep|> that would complete it and "auto" starts the grammar, fed the tokens as sampled;
    near misses (other words, a special token inside) stay free text."""
    tokenizer, _ = setup
    fmt, special = K3ChatFormat(), tokenizer.special_tokens
    spelled = [special[OPEN], *(t for c in "tools" for t in tokenizer.encode(c)), special[SEP]]
    assert (
        spelled != tokenizer.encode(f"{OPEN}tools{SEP}") and tokenizer.decode(spelled) == f"{OPEN}tools{SEP}"
    )
    for tools in (TOOLS, None):
        none = ToolCallGrammar.build(tokenizer, V, tools, "none", markup=fmt.markup).constraint()
        for token in spelled[:-1]:
            assert none.allowed_tokens() is None
            none.advance(token)
        allowed = none.allowed_tokens()
        assert not allowed[special[SEP]] and allowed.sum() == V - 1
    auto = ToolCallGrammar.build(tokenizer, V, TOOLS, "auto", markup=fmt.markup).constraint()
    for token in tokenizer.encode(f"hi{CLOSE}response{SEP}") + spelled:
        assert not auto.in_call
        auto.advance(token)
    allowed = auto.allowed_tokens()
    assert auto.in_call and allowed[special[OPEN]] and allowed.sum() == 1
    for miss in ("tool", "toolss", f"to{CLOSE}ols", "response"):
        none = ToolCallGrammar.build(tokenizer, V, TOOLS, "none", markup=fmt.markup).constraint()
        for token in tokenizer.encode(OPEN + miss):
            none.advance(token)
        assert none.allowed_tokens() is None, miss


def test_schema_branches_in_the_grammar():
    lark = tools_channel_lark([BOUNDED, *TOOLS], parallel=False, forced=True, thinking=False)
    assert lark.startswith(f'start: {CLOSE} "response" {SEP} {OPEN} "tools" {SEP} call {CLOSE}')
    assert (
        '"argument key=\\"note\\" type=\\"string\\""' in lark
        and '"argument key=\\"note\\" type=\\"null\\""' in lark
    )
    assert '"argument key=\\"unit\\" type=\\"string\\"" <|sep|> ("celsius" | "fahrenheit")' in lark
    assert "/(?s:.{2,6})/" in lark and '"argument key=\\"limit\\" type=\\"number\\""' in lark
    with pytest.raises(GrammarError, match="at least one tool"):
        tools_channel_lark([])
