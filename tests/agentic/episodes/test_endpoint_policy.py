"""``EndpointPolicy`` against a thinking model's server: the reply keeps its ``reasoning_content``, so the
transcript carries the thinking into later turns and the turn's ids (and token count) are what the model
wrote, as a ``LocalPolicy`` records the same text; K2's format and K3's XTML. The official ``openai``
client talks to an in-process stub of ``/v1/chat/completions`` (no network)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from k2lab.agentic.episodes.env import Episode
from k2lab.agentic.episodes.rollout import EndpointPolicy, PolicyOutputError, Rollout, parse_reply
from k2lab.runtime.chat_format import ChatFormat, K2ChatFormat, K3ChatFormat
from k2lab.runtime.chat_k3 import with_k3_tokens

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

USER = {"role": "user", "content": "2+2?"}
#: What each format's model writes after the generation prompt for a reply that thinks, then answers "4".
SAMPLED = {
    "k2": "<think>2+2 is 4</think>4<|im_end|>",
    "k3": "2+2 is 4<|close|>think<|sep|><|open|>response<|sep|>4<|close|>response<|sep|>"
    "<|close|>message<|sep|><|end_of_msg|>",
}


def stub_server(policy: EndpointPolicy, message: dict[str, Any], usage: int, finish: str = "stop") -> list:
    """Point ``policy``'s client at a stub that answers every request with ``message`` (and ``usage``
    completion tokens), as ``k2lab serve`` shapes its body; returns the list the request bodies go to."""
    requests: list[dict[str, Any]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        requests.append(json.loads(request.content))
        choice = {"index": 0, "message": message, "finish_reason": finish}
        body = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": policy.model,
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": usage, "total_tokens": usage + 1},
        }
        return httpx.Response(200, json=body)

    http = httpx.Client(transport=httpx.MockTransport(answer))
    policy.client = openai.OpenAI(base_url="http://stub/v1", api_key="k", http_client=http, max_retries=0)
    return requests


def served(family: str, small_tokenizer) -> tuple[ChatFormat, Any, list[int], dict[str, Any]]:
    """The format, tokenizer, the ids of ``SAMPLED[family]`` and the message a server parses from them (the
    one ``LocalPolicy`` parses from the same ids: ``parse_reply``)."""
    fmt, tokenizer = (K2ChatFormat(), small_tokenizer) if family == "k2" else (K3ChatFormat(), None)
    tokenizer = tokenizer or with_k3_tokens(small_tokenizer)
    ids = fmt.encode_text(tokenizer, SAMPLED[family])
    return fmt, tokenizer, ids, parse_reply(tokenizer.decode(ids), fmt)


@pytest.mark.parametrize("family", ["k2", "k3"])
def test_a_reply_keeps_its_thinking_and_its_ids_are_what_the_model_wrote(family, small_tokenizer):
    fmt, tokenizer, sampled, local = served(family, small_tokenizer)
    assert local["reasoning_content"] == "2+2 is 4" and local["content"] == "4"
    policy = EndpointPolicy("http://stub/v1", "m", tokenizer=tokenizer, chat_format=fmt)
    requests = stub_server(policy, local, usage=len(sampled))
    message, ids = policy.respond([USER], [])
    assert message == local and ids == sampled  # the endpoint path and the local path agree
    # the reply continues the prompt as the whole conversation encodes it
    whole = fmt.encode_chat(tokenizer, [USER, message], add_generation_prompt=False).ids
    assert whole == policy.encode_prompt([USER], []) + ids
    # the next turn sends the thinking back and its prompt holds it
    follow = [USER, message, {"role": "user", "content": "and 3+3?"}]
    policy.respond(follow, [])
    assert requests[1]["messages"][1]["reasoning_content"] == "2+2 is 4"
    assert "2+2 is 4" in tokenizer.decode(policy.encode_prompt(follow, []))


def test_a_turns_token_count_is_its_ids_thinking_included(small_tokenizer):
    """The budget penalty's count (``episode.completion_tokens``) is the turn's ids, the thinking among them,
    equal to the server's count for a canonically written reply."""
    from k2lab.agentic.episodes.rollout import _play_turn

    fmt, tokenizer, sampled, local = served("k2", small_tokenizer)
    policy = EndpointPolicy("http://stub/v1", "m", tokenizer=tokenizer, chat_format=fmt)
    stub_server(policy, local, usage=len(sampled))
    rollout = Rollout(Episode(env="stub", seed=0, task_id="t", messages=[USER]))

    class Env:
        def step(self, episode: Episode, message: dict[str, Any]) -> None:
            episode.messages.append(message)
            episode.finish(True, "done")

    assert _play_turn(Env(), policy, rollout, iteration=0, seed=0) == len(sampled)
    assert rollout.turns[0].completion_ids == sampled and rollout.episode.completion_tokens == len(sampled)
    assert rollout.episode.messages[-1]["reasoning_content"] == "2+2 is 4"


def test_vllms_reasoning_field_is_the_reasoning_content(small_tokenizer):
    """Newer vLLM names the thinking ``reasoning``: it is kept as ``reasoning_content`` all the same."""
    fmt, tokenizer, sampled, local = served("k2", small_tokenizer)
    policy = EndpointPolicy("http://stub/v1", "m", tokenizer=tokenizer, chat_format=fmt)
    stub_server(policy, {"role": "assistant", "content": "4", "reasoning": "2+2 is 4"}, usage=len(sampled))
    assert policy.respond([USER], []) == (local, sampled)


def test_without_thinking_a_reply_has_no_think_markup(small_tokenizer):
    policy = EndpointPolicy("http://stub/v1", "m", tokenizer=small_tokenizer)
    stub_server(policy, {"role": "assistant", "content": "4"}, usage=2)
    message, ids = policy.respond([USER], [])
    assert message == {"role": "assistant", "content": "4"} and small_tokenizer.decode(ids) == "4<|im_end|>"


@pytest.mark.parametrize("family", ["k2", "k3"])
def test_a_reply_cut_at_max_tokens_has_no_end_of_turn(family, small_tokenizer):
    """A reply the server stopped at ``max_tokens`` ends without the end-of-turn token, as ``LocalPolicy``'s
    truncated turns do: the model never wrote it."""
    fmt, tokenizer, sampled, local = served(family, small_tokenizer)
    policy = EndpointPolicy("http://stub/v1", "m", tokenizer=tokenizer, chat_format=fmt)
    stub_server(policy, local, usage=len(sampled) - 1, finish="length")
    with pytest.raises(PolicyOutputError, match="truncated") as cut:
        policy.respond([USER], [])
    assert cut.value.completion_ids == sampled[:-1]
