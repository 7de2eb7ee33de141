"""`k2lab serve` of a K3-family model (a random k3-nano with a k2lab tokenizer plus the XTML tokens) speaks K3's
format through the same OpenAI API: the prompt is XTML, forced calls come back as `tool_calls` parsed from the
raw K3 markup the model generated (streaming too), content streams from the response channel only, and a
tokenizer without the XTML tokens is refused."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from k2lab import build_model, load_preset
from k2lab.runtime.chat_format import K2ChatFormat, K3ChatFormat
from k2lab.runtime.chat_k3 import OPEN, SEP, with_k3_tokens
from k2lab.serve import Engine
from k2lab.serve.server import build_app
from tests.conftest import randomize, serving
from tests.serve.test_server import KEY, WEATHER

openai = pytest.importorskip("openai")


class Recording(K3ChatFormat):
    """K3's format, keeping every generated text the server parses."""

    texts: list[str] = []

    def parse_assistant(self, text: str) -> dict:
        self.texts.append(text)
        return super().parse_assistant(text)


@pytest.fixture(scope="module")
def k3_server(small_tokenizer):
    tokenizer = with_k3_tokens(small_tokenizer)
    config = load_preset("k3-nano", vocab_size=320, max_position_embeddings=1024)
    engine = Engine(randomize(build_model(config), seed=0), max_batch=4, prefix_cache_bytes=0).start()
    app = build_app(engine, tokenizer, "k3", api_key=KEY)
    assert app.state.k2lab.chat_format == K3ChatFormat()
    app.state.k2lab.chat_format = Recording()
    with serving(app) as base:
        yield base, tokenizer
    engine.shutdown()


@pytest.fixture
def client(k3_server):
    return openai.OpenAI(base_url=k3_server[0] + "/v1", api_key=KEY, max_retries=0)


def test_prompt_is_k3_markup(k3_server):
    base, tokenizer = k3_server
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}
    tokens = httpx.post(base + "/tokenize", json=body, headers={"Authorization": f"Bearer {KEY}"}).json()[
        "tokens"
    ]
    text = tokenizer.decode(tokens)
    assert text.startswith(f'{OPEN}message role="system" type="tool-declare"{SEP}# Tools')
    assert text.endswith(f'{OPEN}message role="user"{SEP}weather?<|close|>message{SEP}<|end_of_msg|>'
                         f'{OPEN}message role="assistant"{SEP}{OPEN}think{SEP}')  # fmt: skip


def test_forced_tool_calls_come_from_k3_markup(client):
    Recording.texts.clear()
    for seed in range(2):
        out = client.chat.completions.create(
            model="k3", messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER],
            tool_choice="required", parallel_tool_calls=False, max_tokens=250, temperature=0.7, seed=seed,
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", (choice, Recording.texts[-1:])
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id == "functions.get_weather:0"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        raw = Recording.texts[-1]
        assert raw.startswith(f"<|close|>think{SEP}{OPEN}response{SEP}<|close|>response{SEP}{OPEN}tools{SEP}")
        assert f'{OPEN}call tool="get_weather" index="' in raw and raw.endswith(
            f"<|close|>message{SEP}"
        )  # the stop token is not text


def test_streamed_named_call(client):
    Recording.texts.clear()
    stream = client.chat.completions.create(
        model="k3", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
        max_tokens=250, temperature=0.7, seed=5, stream=True,
    )  # fmt: skip
    chunks = list(stream)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert f"{OPEN}tools{SEP}" in Recording.texts[-1]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "" and not any(t in content for t in ("think", "response", "tools"))


def test_free_text_streams_the_response_channel(client):
    kwargs = dict(model="k3", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )
    assert streamed == whole and "<|" not in whole


def test_tokenizer_without_xtml_tokens_keeps_k2s_format(small_tokenizer):
    """A K3-family checkpoint trained with a plain k2lab tokenizer cannot write XTML: it is served in K2's
    format, as before, with a warning."""
    engine = Engine(build_model(load_preset("k3-nano", vocab_size=320)), max_batch=1)
    with pytest.warns(UserWarning, match=r"lacks <\|open\|>, <\|close\|>, <\|sep\|>, <\|end_of_msg\|>"):
        app = build_app(engine, small_tokenizer, "k3")
    assert app.state.k2lab.chat_format == K2ChatFormat()
    assert app.state.k2lab.stop_ids[0] == small_tokenizer.special_tokens["<|im_end|>"]
