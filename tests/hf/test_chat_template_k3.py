"""The K3 chat template against k2lab's K3 renderer: transformers' ``apply_chat_template`` gives byte-identical
text to ``render_chat_k3`` over seeded random conversations (tools with every schema construct, thinking on and
off, effort and tool-choice notes, parallel calls with object arguments, results in any order), and the export
path picks it for K3-family models."""

from __future__ import annotations

import random
from typing import Any

import pytest
from jinja2.exceptions import TemplateError

from k2lab import load_preset
from k2lab.hf.chat_template import chat_template, chat_template_for, chat_template_k3
from k2lab.runtime.chat import ChatFormatError
from k2lab.runtime.chat_k3 import render_chat_k3, with_k3_tokens
from tests.hf.test_chat_template import KEYS, NAMES, content, text, tool
from tests.runtime.test_chat import CONVERSATION, WEATHER

transformers = pytest.importorskip("transformers")

CASES = 200


def calls(rng: random.Random, number: int) -> list[dict[str, Any]]:
    out = []
    for k in range(rng.randint(1, 3)):
        arguments = {
            rng.choice(KEYS): rng.choice([text(rng), 3, -2.5, True, None, [1.5, None], {"é": "日本"}])
            for _ in range(2)
        }
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": rng.choice(NAMES), "arguments": arguments},
        }
        if rng.random() < 0.7:
            call["id"] = f"call_{number}_{k}"
        out.append(call)
    return out


def conversation(rng: random.Random) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": rng.choice(["system", "developer"]), "content": content(rng)})
    seen = 0
    for number in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": content(rng)})
        turn: dict[str, Any] = {"role": "assistant", "content": rng.choice([None, "", content(rng)])}
        if rng.random() < 0.6:
            turn["reasoning_content"] = rng.choice(["", " ", text(rng, 10)])
        if rng.random() < 0.6:
            turn["tool_calls"] = calls(rng, number)
        messages.append(turn)
        results = [
            {"role": "tool", "tool_call_id": c.get("id") or f"functions.{c['function']['name']}:{seen + k}",
             "content": content(rng)}
            for k, c in enumerate(turn.get("tool_calls", []))
        ]  # fmt: skip
        rng.shuffle(results)
        messages += results
        seen += len(turn.get("tool_calls", []))
    return messages


def case(seed: int) -> tuple[list, list | None, dict[str, Any]]:
    rng = random.Random(seed)
    while True:
        messages = conversation(rng)
        tools = [tool(rng, name) for name in rng.sample(NAMES, rng.randint(0, 3))] or None
        options = {
            "add_generation_prompt": rng.random() < 0.5,
            "thinking": rng.random() < 0.7,
            "thinking_effort": rng.choice([None, None, "low", "max"]),
            "tool_choice": rng.choice([None, "auto", "required", "none"]),
        }
        try:
            render_chat_k3(messages, tools, **options)
        except ChatFormatError:
            continue
        return messages, tools, options


@pytest.fixture(scope="module")
def hf_tokenizer(small_tokenizer):
    backend = with_k3_tokens(small_tokenizer).backend
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template_k3())


@pytest.mark.parametrize("block", range(4))
def test_apply_chat_template_equals_render_chat_k3(hf_tokenizer, block):
    kinds = {"tools": 0, "parallel": 0, "results": 0, "thinking_off": 0, "reasoning": 0}
    for seed in range(block * CASES // 4, (block + 1) * CASES // 4):
        messages, tools, options = case(seed)
        ours = render_chat_k3(messages, tools, **options)
        theirs = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options)
        assert theirs == ours, f"seed {seed}"
        kinds["tools"] += tools is not None
        kinds["parallel"] += any(len(m.get("tool_calls") or []) > 1 for m in messages)
        kinds["results"] += any(m["role"] == "tool" for m in messages)
        kinds["thinking_off"] += not options["thinking"]
        kinds["reasoning"] += any(str(m.get("reasoning_content") or "").strip() for m in messages)
    assert min(kinds.values()) >= 3, kinds


def test_golden_conversation_and_family_choice(hf_tokenizer):
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": {"city": "Paris"}}}
                                     for c in m.get("tool_calls", [])]} if m.get("tool_calls") else m
                for m in CONVERSATION]  # fmt: skip
    theirs = hf_tokenizer.apply_chat_template(
        messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert theirs == render_chat_k3(CONVERSATION, tools=[WEATHER])
    assert chat_template_for(load_preset("k3-nano")) == chat_template_k3()
    assert chat_template_for(load_preset("k2-nano")) == chat_template()
    with pytest.warns(UserWarning, match="speaks K2's chat format"):  # a tokenizer without the XTML tokens
        assert chat_template_for(load_preset("k3-nano"), {"<|im_end|>": 5}) == chat_template()


# ------------------------------------------------------------------------ what both refuse, in the same words


def raw_call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": {}}}


def result(call_id: str, content: str = "r") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


USER = {"role": "user", "content": "u"}
TWO_CALLS = {"role": "assistant", "content": "", "tool_calls": [raw_call("c1", "f"), raw_call("c2", "g")]}
REFUSED = {  # conversations the template rendered with a tool result left out (or tagged as another call's)
    "unmatched id": ([USER, TWO_CALLS, result("c1"), result("c2"), result("zzz", "LOST?")], {}),
    "tool result first": ([result("x", "orphan"), USER], {}),
    "only call 2 answered": ([USER, TWO_CALLS, result("c2")], {}),
    "call 1 answered twice": ([USER, TWO_CALLS, result("c1"), result("c1")], {}),
    "after a turn without calls": ([USER, {"role": "assistant", "content": "a"}, result("c1")], {}),
    "after a user turn": ([USER, TWO_CALLS, result("c1"), result("c2"), USER, result("c1")], {}),
    "unknown role": ([USER, {"role": "function", "content": "x"}], {}),
    "thinking_effort medium": ([USER], {"thinking_effort": "medium"}),
}


@pytest.mark.parametrize("name", REFUSED)
def test_the_template_refuses_what_render_chat_k3_refuses(hf_tokenizer, name):
    """Through transformers' renderer the template raises, as render_chat_k3 does and with its message."""
    messages, options = REFUSED[name]
    with pytest.raises(ChatFormatError) as ours:
        render_chat_k3(messages, **options)
    with pytest.raises(TemplateError) as theirs:
        hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
    assert str(theirs.value) == str(ours.value)


def shuffled_results(rng: random.Random, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with one tool result dropped, doubled, moved or re-addressed (to an earlier call's client or
    K2 id, or to nothing), or a stray one inserted: sometimes still what K3 can carry, often not."""
    out = [dict(m) for m in messages]
    ids = [c.get("id") or "functions.f:0" for m in out for c in m.get("tool_calls") or []] + ["zzz"]
    results = [k for k, m in enumerate(out) if m["role"] == "tool"] or [len(out)]
    k = rng.choice(results)
    change = rng.choice(["drop", "double", "move", "readdress", "k2_id", "insert"])
    if change == "insert" or k == len(out):
        out.insert(rng.randrange(len(out) + 1), result(rng.choice(ids)))
    elif change == "drop":
        del out[k]
    elif change == "double":
        out.insert(k, dict(out[k]))
    elif change == "move":
        out.insert(rng.randrange(len(out)), out.pop(k))
    else:
        k2_id = f"functions.{rng.choice(NAMES)}:{rng.randrange(4)}"
        out[k]["tool_call_id"] = k2_id if change == "k2_id" else rng.choice(ids)
    return out


def test_the_template_agrees_on_misplaced_tool_results(hf_tokenizer):
    """Over conversations with results out of place: both refuse (same message) or both give the same text."""
    outcomes = {"refused": 0, "rendered": 0}
    for seed in range(CASES):
        messages, tools, options = case(seed)
        messages = shuffled_results(random.Random(seed), messages)
        try:
            ours = render_chat_k3(messages, tools, **options)
        except ChatFormatError as error:
            ours = f"refused: {error}"
        try:
            theirs = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options)
        except TemplateError as error:
            theirs = f"refused: {error}"
        assert theirs == ours, f"seed {seed}"
        outcomes["refused" if ours.startswith("refused: ") else "rendered"] += 1
    assert min(outcomes.values()) >= CASES // 10, outcomes
