"""A generated turn's thinking as the chat formats write it: where it ends (K2's leading ``<think>...</think>``,
K3's think channel), the part of it a stream can send while it grows, and the reply after it, for a turn
whose tool-call markup does not parse.

``k2lab.runtime.chat_format`` parses a whole turn; the server also needs the reasoning of a turn still being
generated, streamed as it grows (as vLLM streams ``reasoning_content`` while the thinking is open) less a tail
that could still begin the thinking's close, and the reply around a turn that does not parse. Such a turn
comes back as vLLM and SGLang return a tool call their parser refuses: its text, the thinking left to
``reasoning_content`` and special tokens left out.
"""

from __future__ import annotations

from k2lab.runtime import chat
from k2lab.runtime.chat_format import ChatFormat, K3ChatFormat
from k2lab.runtime.chat_k3 import MESSAGE_CLOSE, RESPONSE_OPEN, THINK_CLOSE
from k2lab.serve.holdback import settled

__all__ = ["after_thinking", "settled_reasoning", "thinking_end"]


def thinking_end(fmt: ChatFormat) -> str | None:
    """The markup that closes a turn's thinking: K2's ``</think>``, K3's think channel close (None: K3 with
    thinking off, whose turn opens in the response channel)."""
    if isinstance(fmt, K3ChatFormat):
        return THINK_CLOSE if fmt.thinking else None
    return chat.THINK_END


def after_thinking(fmt: ChatFormat, text: str) -> str:
    """The raw turn after its thinking, through the end of the turn: all of it without thinking, "" while the
    thinking is open. K3: from the response channel's text (its opening left out) up to the message close."""
    end = thinking_end(fmt)
    if isinstance(fmt, K3ChatFormat):
        if end is not None:
            text = text.split(end, 1)[1].removeprefix(RESPONSE_OPEN) if end in text else ""
        return text.removesuffix(MESSAGE_CLOSE)
    if not text.startswith(chat.THINK_BEGIN):
        return text
    return text.split(chat.THINK_END, 1)[1] if chat.THINK_END in text else ""


def settled_reasoning(fmt: ChatFormat, text: str) -> str:
    """The reasoning of a turn so far (``fmt.reasoning``) that later tokens can no longer change: all of it
    once the thinking has closed; while it is open, less a tail that could still begin its close (K3's
    ``<|close|>th``) and a trailing half UTF-8 character."""
    reasoning, end = fmt.reasoning(text) or "", thinking_end(fmt)
    if end is None or end in text:
        return reasoning
    begun = next(
        (k for k in range(min(len(end) - 1, len(reasoning)), 0, -1) if reasoning.endswith(end[:k])), 0
    )
    reasoning = reasoning[: len(reasoning) - begun]
    return reasoning[: settled(reasoning, ())]
