"""A ``LocalPolicy`` over a K3-family model speaks K3's XTML format: its prompts are K3's rendering, it stops at
``<|end_of_msg|>``, its enforcer triggers on K3's tools channel and its replies parse as K3."""

from __future__ import annotations

import pytest

from k2lab import build_model, load_preset
from k2lab.agentic.episodes.rollout import EndpointPolicy, LocalPolicy, PolicyOutputError, parse_reply
from k2lab.runtime.chat_format import K3ChatFormat
from k2lab.runtime.chat_k3 import CLOSE, OPEN, SEP, TOOLS_OPEN, render_chat_k3, with_k3_tokens
from tests.conftest import randomize
from tests.serve.test_server import WEATHER


def test_local_policy_speaks_k3(small_tokenizer):
    tokenizer = with_k3_tokens(small_tokenizer)
    model = randomize(build_model(load_preset("k3-nano", vocab_size=320, max_position_embeddings=1024)))
    policy = LocalPolicy(model, tokenizer, max_new_tokens=8, prefix_cache_bytes=0)
    assert policy.chat_format.family == "k3" and policy.im_end == tokenizer.special_tokens["<|end_of_msg|>"]
    messages = [{"role": "user", "content": "weather in Paris?"}]
    assert tokenizer.decode(policy.encode_prompt(messages, [WEATHER])) == render_chat_k3(messages, [WEATHER])
    assert policy._grammar([WEATHER]).trigger == tuple(tokenizer.encode(TOOLS_OPEN))
    (prompt, reply) = policy.respond_batch([(messages, [WEATHER], 0)])[0]
    assert prompt == policy.encode_prompt(messages, [WEATHER]) and isinstance(
        reply, PolicyOutputError | tuple
    )
    text = (
        f"hm{CLOSE}think{SEP}{OPEN}response{SEP}{CLOSE}response{SEP}{TOOLS_OPEN}"
        f'{OPEN}call tool="get_weather" index="1"{SEP}{OPEN}argument key="city" type="string"{SEP}Paris'
        f"{CLOSE}argument{SEP}{CLOSE}call{SEP}{CLOSE}tools{SEP}{CLOSE}message{SEP}<|end_of_msg|>"
    )
    message = parse_reply(text, policy.chat_format)
    assert (
        message["reasoning_content"] == "hm"
        and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    )
    with pytest.warns(UserWarning, match="speaks K2's chat format"):  # a plain tokenizer cannot write XTML
        assert LocalPolicy(model, small_tokenizer, prefix_cache_bytes=0).chat_format.family == "k2"


def test_endpoint_policy_re_encodes_in_the_served_models_format(small_tokenizer):
    """With K3's format an ``EndpointPolicy``'s prompt ids are K3's rendering and a reply's ids what the model
    writes after that prompt (through ``<|end_of_msg|>``), as a ``LocalPolicy`` records them; K2's by default."""
    tokenizer = with_k3_tokens(small_tokenizer)
    policy = EndpointPolicy("http://127.0.0.1:9/v1", "k3", tokenizer=tokenizer, chat_format=K3ChatFormat())
    messages = [{"role": "user", "content": "weather in Paris?"}]
    prompt = render_chat_k3(messages, [WEATHER])
    assert tokenizer.decode(policy.encode_prompt(messages, [WEATHER])) == prompt
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    reply = {"role": "assistant", "content": "Checking.", "tool_calls": [call]}
    ids = policy._encode_reply(reply)
    whole = render_chat_k3([*messages, reply], [WEATHER], add_generation_prompt=False)
    assert whole.startswith(prompt) and tokenizer.decode(ids) == whole[len(prompt) :]
    assert ids[-1] == tokenizer.special_tokens["<|end_of_msg|>"]
    parsed = parse_reply(tokenizer.decode(ids), policy.chat_format)
    assert parsed["content"] == "Checking." and parsed["tool_calls"][0]["function"]["name"] == "get_weather"
    k2 = EndpointPolicy("http://127.0.0.1:9/v1", "k2", tokenizer=small_tokenizer)
    assert k2.chat_format.family == "k2"
    assert small_tokenizer.decode(k2._encode_reply({"role": "assistant", "content": "hi"})) == "hi<|im_end|>"
