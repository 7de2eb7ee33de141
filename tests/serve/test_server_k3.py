"""`k2lab serve` of a K3-family model (a random k3-nano with a k2lab tokenizer plus the XTML tokens) speaks K3's
format through the same OpenAI API: the prompt is XTML, forced calls come back as `tool_calls` parsed from the
raw K3 markup the model generated (streaming too). With a scripted engine (fixed replies): content comes from
the response channel only, whole and streamed alike, a stop string cuts that channel (reasoning kept), and
`tool_choice: "none"` never returns calls. A tokenizer without the XTML tokens keeps K2's format (a warning)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

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


class Scripted:
    """An engine stand-in: every request gets ``tokens`` (then ``finish``), whatever its constraint allows, as
    a model spelling markup in pieces the enforcer does not expect would."""

    def __init__(self, config) -> None:
        self.config, self.tokens, self.finish = config, [], "stop"
        self.model = self.prefix_cache = self.speculation = None
        self.active = 0

    def submit(self, request):
        for token in self.tokens:
            request.on_token(token)
        request.on_finish(self.finish)
        return request


REPLY = f"I should greet.<|close|>think{SEP}{OPEN}response{SEP}hello STOP more<|close|>response{SEP}"
CALL = (
    f'{OPEN}tools{SEP}{OPEN}call tool="get_weather" index="1"{SEP}{OPEN}argument key="city" type="string"{SEP}'
    f'Paris<|close|>argument{SEP}{OPEN}argument key="unit" type="string"{SEP}c<|close|>argument{SEP}'
    f"<|close|>call{SEP}<|close|>tools{SEP}"
)


@pytest.fixture(scope="module")
def scripted(small_tokenizer):
    tokenizer = with_k3_tokens(small_tokenizer)
    engine = Scripted(load_preset("k3-nano", vocab_size=320, max_position_embeddings=1024))
    app = build_app(engine, tokenizer, "k3", api_key=KEY)
    assert app.state.k2lab.chat_format == K3ChatFormat()
    with serving(app) as base:
        yield base, engine, tokenizer


def ask(scripted, reply: str, stream: bool = False, cut: bool = False, **body) -> tuple[Any, str]:
    """The engine replies ``reply`` (+ the turn's close; ``cut``: not closed, finishing "length"); the
    message (or the streamed deltas, in order) and the finish reason, as the server's raw JSON."""
    base, engine, tokenizer = scripted
    engine.tokens = tokenizer.encode(reply if cut else reply + f"<|close|>message{SEP}")
    engine.finish = "length" if cut else "stop"
    return chat_reply(base, {"model": "k3", "stream": stream, **body})


def chat_reply(base: str, body: dict) -> tuple[Any, str]:
    """POST ``body`` (a "hi" from the user added) to the chat route: the message (or the streamed deltas, in
    order) and the finish reason, as the server's raw JSON."""
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    response = httpx.post(
        base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        choice = response.json()["choices"][0]
        return choice["message"], choice["finish_reason"]
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line)["choices"][0] for line in lines[:-1]]
    return [c["delta"] for c in chunks], chunks[-1]["finish_reason"]


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def assert_cut_inside_thinking(
    ask: Callable[..., tuple[Any, str]], scripted: Any, reply: str, reasoning: str
) -> None:
    """``reply`` cut by max_tokens while thinking (``ask``: the format's scripted request) comes back as
    ``reasoning`` with no content and finish "length", whole and streamed alike."""
    message, reason = ask(scripted, reply, cut=True)
    assert message == {"role": "assistant", "content": "", "reasoning_content": reasoning}
    assert reason == "length"
    deltas, reason = ask(scripted, reply, stream=True, cut=True)
    assert joined(deltas, "reasoning_content") == reasoning and joined(deltas, "content") == ""
    assert reason == "length"


def assert_reasoning_streams_first(deltas: list[dict], reasoning: str, content: str) -> None:
    """The reasoning came in several deltas (token by token, as vLLM streams it), all before the first
    content delta, and the deltas join to the non-streamed message's ``reasoning`` and ``content``."""
    kinds = [key for d in deltas for key in ("reasoning_content", "content") if d.get(key)]
    assert kinds.count("reasoning_content") > 1 and kinds == sorted(kinds, key=lambda key: key == "content")
    assert (joined(deltas, "reasoning_content"), joined(deltas, "content")) == (reasoning, content)


def test_the_reasoning_streams_as_it_grows_before_the_content(scripted):
    """Was: the reasoning as one delta after every content delta."""
    reply = REPLY.replace("hello STOP more", "hello there")
    whole, _ = ask(scripted, reply)
    deltas, _ = ask(scripted, reply, stream=True)
    assert_reasoning_streams_first(deltas, whole["reasoning_content"], whole["content"])


def test_free_text_streams_the_response_channel(scripted):
    reply = REPLY.replace("hello STOP more", "hello there")
    whole, reason = ask(scripted, reply)
    assert whole == {"role": "assistant", "content": "hello there", "reasoning_content": "I should greet."}
    deltas, streamed_reason = ask(scripted, reply, stream=True)
    assert joined(deltas, "content") == whole["content"] and reason == streamed_reason == "stop"
    assert joined(deltas, "reasoning_content") == "I should greet."


def test_a_stop_string_cuts_the_response_channel(scripted):
    message, reason = ask(scripted, REPLY, stop=["STOP"])
    assert message == {"role": "assistant", "content": "hello ", "reasoning_content": "I should greet."}
    assert reason == "stop"
    deltas, reason = ask(scripted, REPLY, stream=True, stop=["STOP"])
    assert joined(deltas, "content") == "hello " and reason == "stop"
    assert joined(deltas, "reasoning_content") == "I should greet."
    message, _ = ask(scripted, REPLY, stop=["greet"])  # a stop string in the reasoning is not content
    assert message["content"] == "hello STOP more"


def test_a_reply_cut_inside_the_think_channel_keeps_its_reasoning(scripted):
    """max_tokens reached while thinking: the reasoning so far, no content, finish "length" (was: an empty
    content and no reasoning, streamed as nothing); cut inside the tools channel, the reasoning stays too."""
    assert_cut_inside_thinking(ask, scripted, "I should greet the", "I should greet the")
    unfinished = REPLY.replace("hello STOP more", "hi") + CALL[:60]
    message, reason = ask(scripted, unfinished, cut=True, tools=[WEATHER])
    assert message["reasoning_content"] == "I should greet." and reason == "length"


def test_tool_choice_none_never_returns_calls(scripted):
    reply = REPLY.replace("hello STOP more", "hi") + CALL
    message, reason = ask(scripted, reply, tools=[WEATHER])  # "auto": the same reply is a call
    assert reason == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris",
        "unit": "c",
    }
    message, reason = ask(scripted, reply, tools=[WEATHER], tool_choice="none")
    assert message == {"role": "assistant", "content": "hi", "reasoning_content": "I should greet."}
    assert reason == "stop"
    deltas, reason = ask(scripted, reply, stream=True, tools=[WEATHER], tool_choice="none")
    assert (
        not any("tool_calls" in d for d in deltas) and joined(deltas, "content") == "hi" and reason == "stop"
    )


def test_a_finished_turn_whose_tool_calls_do_not_parse_keeps_all_its_text(scripted):
    """A closed tools channel that does not parse (an argument key repeated) and what follows it are content,
    special tokens left out (was: "hi" alone, the call lost, finish "stop")."""
    broken = CALL.replace('key="unit"', 'key="city"')
    reply = REPLY.replace("hello STOP more", "hi") + broken
    message, reason = ask(scripted, reply, tools=[WEATHER])
    text = 'hiresponsetoolscall tool="get_weather" index="1"argument key="city" type="string"Parisargument'
    text += 'argument key="city" type="string"cargumentcalltools'
    assert message == {"role": "assistant", "content": text, "reasoning_content": "I should greet."}
    deltas, reason = ask(scripted, reply, stream=True, tools=[WEATHER])
    assert joined(deltas, "content") == text and reason == "stop"


def test_tokenizer_without_xtml_tokens_keeps_k2s_format(small_tokenizer):
    """A K3-family checkpoint trained with a plain k2lab tokenizer cannot write XTML: it is served in K2's
    format, as before, with a warning."""
    engine = Engine(build_model(load_preset("k3-nano", vocab_size=320)), max_batch=1)
    with pytest.warns(UserWarning, match=r"lacks <\|open\|>, <\|close\|>, <\|sep\|>, <\|end_of_msg\|>"):
        app = build_app(engine, small_tokenizer, "k3")
    assert app.state.k2lab.chat_format == K2ChatFormat()
    assert app.state.k2lab.stop_ids[0] == small_tokenizer.special_tokens["<|im_end|>"]
