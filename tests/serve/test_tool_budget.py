"""Issue 22's scenario through the official `openai` client: a forced call to a tool whose schema has an
enum, an integer and an array of booleans, on a random model (flat logits: numbers run on), temperature 1,
seeds 0–4 — every response carries a call that validates, at max_tokens 64 and at the call's shortest form;
one token less gives finish_reason "length" and no call."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from k2lab import build_model, load_preset
from k2lab.runtime.enforcer import ToolCallGrammar
from k2lab.serve import Engine
from k2lab.serve.server import build_app
from tests.conftest import randomize, serving
from tests.runtime.test_budget import ISSUE as SCHEMA

openai = pytest.importorskip("openai")

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
CHOICE = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(small_tokenizer):
    model = randomize(
        build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=512)), seed=0
    )
    engine = Engine(model, max_batch=16).start()
    with serving(build_app(engine, small_tokenizer, "nano")) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    engine.shutdown()


def ask(client, max_tokens: int, seed: int):
    return client.chat.completions.create(
        model="nano", messages=[{"role": "user", "content": "weather in Paris for 3 days?"}], tools=[TOOL],
        tool_choice=CHOICE, max_tokens=max_tokens, temperature=1.0, seed=seed,
    ).choices[0]  # fmt: skip


def test_forced_call_always_fits(client, small_tokenizer):
    shortest = len(ToolCallGrammar.build(small_tokenizer, 300, [TOOL], CHOICE).shortest_call)
    asks = [(max_tokens, seed) for max_tokens in (64, shortest, shortest - 1) for seed in range(5)]
    with ThreadPoolExecutor(len(asks)) as pool:  # concurrent: the engine batches them
        choices = list(pool.map(lambda a: ask(client, *a), asks))
    for (max_tokens, seed), choice in zip(asks, choices, strict=True):
        if max_tokens < shortest:
            assert choice.finish_reason == "length" and not choice.message.tool_calls, (seed, choice)
            continue
        assert choice.finish_reason == "tool_calls", (max_tokens, seed, choice)
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
