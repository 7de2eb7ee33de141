"""`k2lab serve` of a K2 model whose reply opens with ``<think>`` (several BPE tokens): streamed content equals
the non-streamed content (``<th`` is held back until it cannot open the thinking); a stop string is matched in
the reply after ``</think>`` and the reasoning is kept; a reply cut inside the thinking is its reasoning only."""

from __future__ import annotations

from typing import Any

import pytest

from k2lab import load_preset
from k2lab.runtime.chat_format import K2ChatFormat
from k2lab.serve.server import build_app
from tests.conftest import serving
from tests.serve.test_server import KEY
from tests.serve.test_server_k3 import (
    Scripted,
    assert_cut_inside_thinking,
    assert_reasoning_streams_first,
    chat_reply,
    joined,
)

REPLY = "<think>reason</think>answer here"


@pytest.fixture(scope="module")
def scripted(small_tokenizer):
    engine = Scripted(load_preset("k2-nano", vocab_size=300, max_position_embeddings=512))
    app = build_app(engine, small_tokenizer, "nano", api_key=KEY)
    assert app.state.k2lab.chat_format == K2ChatFormat()
    assert len(small_tokenizer.encode("<think>")) > 1  # the case that streamed "<th", then took it back
    with serving(app) as base:
        yield base, engine, small_tokenizer


def ask(scripted, reply: str, stream: bool = False, cut: bool = False, **body) -> tuple[Any, str]:
    """The engine replies ``reply`` (+ ``<|im_end|>``; ``cut``: not ended, finishing "length"); the message
    (or the streamed deltas, in order) and the finish reason, as the server's raw JSON."""
    base, engine, tokenizer = scripted
    engine.tokens = tokenizer.encode(reply if cut else reply + "<|im_end|>")
    engine.finish = "length" if cut else "stop"
    return chat_reply(base, {"model": "nano", "stream": stream, **body})


def test_a_reply_opening_with_think_streams_what_it_returns(scripted):
    """Was: content "answer here" whole, "<think here" streamed ("<th" sent, then the answer's first three
    characters skipped)."""
    whole, reason = ask(scripted, REPLY)
    assert whole == {"role": "assistant", "content": "answer here", "reasoning_content": "reason"}
    deltas, streamed_reason = ask(scripted, REPLY, stream=True)
    assert joined(deltas, "content") == "answer here" and joined(deltas, "reasoning_content") == "reason"
    assert reason == streamed_reason == "stop"
    for text in ("<th", "<thin", "<tho and more"):  # a reply that only looked like it opened thinking
        whole, _ = ask(scripted, text)
        deltas, _ = ask(scripted, text, stream=True)
        assert whole["content"] == joined(deltas, "content") == text


def test_the_reasoning_streams_as_it_grows_before_the_content(scripted):
    """Was: the reasoning as one delta after every content delta; a partial "</think>" is never sent."""
    reply = "<think>thinking it over</think>answer here"
    whole, _ = ask(scripted, reply)
    deltas, _ = ask(scripted, reply, stream=True)
    assert_reasoning_streams_first(deltas, "thinking it over", "answer here")
    assert whole["reasoning_content"] == "thinking it over" and whole["content"] == "answer here"
    assert not any("<" in d.get("reasoning_content", "") for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_reply_after_the_thinking(scripted, stream):
    """Was: content "<think>reason</think>an", no reasoning_content."""
    out, reason = ask(scripted, REPLY, stream=stream, stop=["sw"])
    content, reasoning = (
        (joined(out, "content"), joined(out, "reasoning_content"))
        if stream
        else (out["content"], out.get("reasoning_content"))
    )
    assert (content, reasoning, reason) == ("an", "reason", "stop")
    message, _ = ask(scripted, REPLY, stop=["aso"])  # a stop string in the reasoning is not content
    assert message == {"role": "assistant", "content": "answer here", "reasoning_content": "reason"}


def test_a_reply_cut_inside_the_thinking_is_its_reasoning(scripted):
    """max_tokens reached while thinking: the reasoning so far, no content, finish "length" (was: content
    "<think>rea")."""
    assert_cut_inside_thinking(ask, scripted, "<think>rea", "rea")
    message, _ = ask(scripted, "<think>reason</think>ans", cut=True)  # cut after it: both
    assert message == {"role": "assistant", "content": "ans", "reasoning_content": "reason"}


BROKEN = (
    "hi <|tool_calls_section_begin|><|tool_call_begin|>not an id<|tool_call_end|><|tool_calls_section_end|> x"
)


def test_a_finished_turn_whose_tool_calls_do_not_parse_keeps_all_its_text(scripted):
    """A complete tool-call section that does not parse, and the text after it, are content (special tokens
    left out), whole and streamed alike, as vLLM returns it (was: "hi ", the rest lost with finish "stop");
    cut by max_tokens, the reply is still the text before the section."""
    reply = "<think>reason</think>" + BROKEN
    expected = {"role": "assistant", "content": "hi not an id x", "reasoning_content": "reason"}
    assert ask(scripted, reply) == (expected, "stop")
    deltas, reason = ask(scripted, reply, stream=True)
    assert (joined(deltas, "content"), joined(deltas, "reasoning_content"), reason) == (
        "hi not an id x",
        "reason",
        "stop",
    )
    assert ask(scripted, reply, cut=True) == ({**expected, "content": "hi "}, "length")
