"""The K3 chat template against k2lab's K3 renderer: transformers' ``apply_chat_template`` gives byte-identical
text to ``render_chat_k3`` over seeded random conversations (tools with every schema construct, thinking on and
off, effort and tool-choice notes, parallel calls with object arguments, results in any order), and the export
path picks it for K3-family models."""

from __future__ import annotations

import random
from typing import Any

import pytest

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
