"""A ``LocalPolicy`` over a K3-family model speaks K3's XTML format: its prompts are K3's rendering, it stops at
``<|end_of_msg|>``, its enforcer triggers on K3's tools channel and its replies parse as K3."""

from __future__ import annotations

import pytest

from k2lab import build_model, load_preset
from k2lab.agentic.episodes.rollout import LocalPolicy, PolicyOutputError, parse_reply
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
