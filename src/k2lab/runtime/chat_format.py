"""A model family's chat format, chosen by its config: K2's (``k2lab.runtime.chat``) or K3's XTML
(``k2lab.runtime.chat_k3``).

``chat_format_for(config)`` is the one place that decides: a config with any K3-only feature
(``k2lab.family.is_k3_family``, the same test that makes a checkpoint ``kimi_k3``: Block AttnRes, a gated
MLA output, LatentMoE, SiTU-GLU MLPs, a lower-bounded or full-rank-gated KDA — what ``k3`` / ``k3-nano``
have) speaks K3; K2, K2.5, Kimi Linear and DeepSeek-V3 configs speak K2 (and so does a K3-family model
whose tokenizer lacks the XTML tokens, with a warning).
Serving, rollouts and the exported chat template ask it rather than calling ``render_chat`` directly.

A ``ChatFormat`` renders (``render_chat``), normalises (``normalize_messages``) and parses
(``parse_assistant`` for a generated turn, ``parse_chat`` for a conversation); ``visible_content`` is
the content of a partly generated turn (before any tool call, reasoning left out) for streaming;
``turn_end`` is the special token that ends an assistant turn (the serving stop token) and ``markup``
the tool-call syntax for the decoding enforcer (``ToolCallGrammar.build(..., markup=fmt.markup)``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from k2lab.config import ModelConfig
from k2lab.data.tokenizer import Tokenizer
from k2lab.family import is_k3_family
from k2lab.runtime import chat
from k2lab.runtime.chat_k3 import (
    CLOSE,
    END_OF_MSG,
    K3_TOKENS,
    MESSAGE_CLOSE,
    OPEN,
    RESERVED,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    encode_chat_k3,
    generation_prompt,
    normalize_messages_k3,
    render_assistant_body_k3,
    render_chat_k3,
)
from k2lab.runtime.chat_k3_parse import parse_assistant_k3, parse_chat_k3
from k2lab.runtime.enforcer import K2_MARKUP, Markup
from k2lab.runtime.tool_grammar_k3 import k3_markup

__all__ = ["ChatFormat", "K2ChatFormat", "K3ChatFormat", "chat_format_for", "chat_format_of", "is_k3_family"]

Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]] | None


class ChatFormat:
    """The interface (module doc); ``K2ChatFormat`` and ``K3ChatFormat`` implement it."""

    family: str
    turn_end: str
    generation_prompt: str
    required_tokens: tuple[str, ...]

    markup_strings: tuple[
        str, ...
    ]  # what the format writes as markup (special ids where the tokenizer has them)

    @property
    def markup(self) -> Markup:
        raise NotImplementedError

    def encode_text(self, tokenizer: Tokenizer, text: str) -> list[int]:
        """Ids of a rendered prompt: only ``markup_strings`` become special ids (``chat.encode_markup_text``)."""
        return chat.encode_markup_text(tokenizer, text, self.markup_strings)

    def render_chat(
        self,
        messages: Messages,
        tools: Tools = None,
        add_generation_prompt: bool = True,
        tool_choice: object = None,
    ) -> str:
        raise NotImplementedError

    def normalize_messages(self, messages: Messages) -> list[dict[str, Any]]:
        raise NotImplementedError

    def parse_assistant(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def parse_chat(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def visible_content(self, text: str) -> str:
        raise NotImplementedError

    def text_before_calls(self, text: str) -> str:
        """What stop strings are matched in and cut from, and the content of a turn that does not parse."""
        raise NotImplementedError

    def reasoning(self, text: str) -> str | None:
        """The reasoning of a turn cut short (a stop string, or ``max_tokens`` with the thinking still
        open) or that does not parse (``text_before_calls`` leaves it out); None when there is none."""
        return None

    def encode_chat(
        self,
        tokenizer: Tokenizer,
        conversation: str | Messages,
        tools: Tools = None,
        add_generation_prompt: bool = False,
    ) -> chat.ChatEncoding:
        """Ids and the assistant mask of a conversation (``k2lab.runtime.chat.encode_chat`` for K2)."""
        raise NotImplementedError

    def completion_text(self, message: Mapping[str, Any]) -> str:
        """What the model writes after ``generation_prompt`` for the assistant ``message`` (normalised
        first), through ``turn_end``: the text of a policy's completion ids."""
        raise NotImplementedError

    def missing_tokens(self, special: Mapping[str, int]) -> list[str]:
        """The format's special tokens that a tokenizer (its ``special_tokens``) lacks."""
        return [token for token in self.required_tokens if token not in special]


@dataclass(frozen=True)
class K2ChatFormat(ChatFormat):
    """K2's format (``k2lab.runtime.chat``); ``tool_format``: ``typescript`` or ``json`` declarations."""

    tool_format: str = "typescript"
    family = "k2"
    turn_end = chat.IM_END
    markup_strings = chat.MARKUP
    generation_prompt = chat.GENERATION_PROMPT
    required_tokens = (
        chat.IM_SYSTEM,
        chat.IM_USER,
        chat.IM_ASSISTANT,
        chat.IM_MIDDLE,
        chat.IM_END,
        *chat.CALL_MARKERS,
    )

    @property
    def markup(self) -> Markup:
        return K2_MARKUP

    def render_chat(
        self,
        messages: Messages,
        tools: Tools = None,
        add_generation_prompt: bool = True,
        tool_choice: object = None,
    ) -> str:
        """K2's rendering (``tool_choice`` is not rendered: K2's template has no note for it)."""
        return chat.render_chat(messages, tools, self.tool_format, add_generation_prompt)

    def normalize_messages(self, messages: Messages) -> list[dict[str, Any]]:
        return chat.normalize_messages(messages)

    def encode_chat(
        self,
        tokenizer: Tokenizer,
        conversation: str | Messages,
        tools: Tools = None,
        add_generation_prompt: bool = False,
    ) -> chat.ChatEncoding:
        return chat.encode_chat(tokenizer, conversation, tools, self.tool_format, add_generation_prompt)

    def completion_text(self, message: Mapping[str, Any]) -> str:
        return chat.render_assistant_body(chat.normalize_messages([message])[0]) + chat.IM_END

    def parse_assistant(self, text: str) -> dict[str, Any]:
        return chat.parse_assistant(text)

    def parse_chat(self, text: str) -> list[dict[str, Any]]:
        return chat.parse_chat(text)

    def text_before_calls(self, text: str) -> str:
        """Text before any tool-call section, a leading ``<think>...</think>`` left out: nothing while that
        thinking is still open (a stop string is matched in the reply, not in its reasoning)."""
        text = text.split(chat.SECTION_BEGIN, 1)[0]
        if text.startswith(chat.THINK_BEGIN):
            text = text.split(chat.THINK_END, 1)[1] if chat.THINK_END in text else ""
        return text

    def reasoning(self, text: str) -> str | None:
        """The leading ``<think>`` block's text, closed or still open (before any tool-call section),
        unless blank."""
        text = text.split(chat.SECTION_BEGIN, 1)[0]
        if not text.startswith(chat.THINK_BEGIN):
            return None
        reasoning = text[len(chat.THINK_BEGIN) :].split(chat.THINK_END, 1)[0]
        return reasoning if reasoning.strip() else None

    def visible_content(self, text: str) -> str:
        """``text_before_calls``, and nothing while the turn so far could still open with ``<think>``
        (``<th`` is held back: streamed, it could not be taken back once the thinking opens)."""
        if chat.THINK_BEGIN.startswith(text):
            return ""
        return self.text_before_calls(text)


@dataclass(frozen=True)
class K3ChatFormat(ChatFormat):
    """K3's XTML format; ``thinking``: the generation prompt opens the think channel (K3's default) and
    assistant turns carry one; ``thinking_effort``: the released effort note (None: none)."""

    thinking: bool = True
    thinking_effort: str | None = None
    family = "k3"
    turn_end = END_OF_MSG
    markup_strings = RESERVED
    required_tokens = K3_TOKENS

    @property
    def generation_prompt(self) -> str:  # type: ignore[override]
        return generation_prompt(self.thinking)

    @property
    def markup(self) -> Markup:
        return k3_markup(self.thinking)

    def render_chat(
        self,
        messages: Messages,
        tools: Tools = None,
        add_generation_prompt: bool = True,
        tool_choice: object = None,
    ) -> str:
        return render_chat_k3(
            messages, tools, add_generation_prompt, self.thinking, self.thinking_effort, tool_choice
        )

    def normalize_messages(self, messages: Messages) -> list[dict[str, Any]]:
        return normalize_messages_k3(messages, self.thinking)

    def encode_chat(
        self,
        tokenizer: Tokenizer,
        conversation: str | Messages,
        tools: Tools = None,
        add_generation_prompt: bool = False,
    ) -> chat.ChatEncoding:
        if not isinstance(conversation, str):
            conversation = self.render_chat(conversation, tools, add_generation_prompt)
        return encode_chat_k3(tokenizer, conversation, thinking=self.thinking)

    def completion_text(self, message: Mapping[str, Any]) -> str:
        """The assistant body and ``<|close|>message<|sep|><|end_of_msg|>``, less the channel the
        generation prompt opens (think, or response with thinking off)."""
        normal = normalize_messages_k3([message], self.thinking)[0]
        body = render_assistant_body_k3(normal, self.thinking) + MESSAGE_CLOSE + END_OF_MSG
        return body[len(THINK_OPEN if self.thinking else RESPONSE_OPEN) :]

    def parse_assistant(self, text: str) -> dict[str, Any]:
        return parse_assistant_k3(text, self.thinking)

    def parse_chat(self, text: str) -> list[dict[str, Any]]:
        return parse_chat_k3(text, self.thinking)

    def text_before_calls(self, text: str) -> str:
        """The response channel's text (markup words such as ``response`` are not text)."""
        return self.visible_content(text)

    def reasoning(self, text: str) -> str | None:
        """The think channel's text (with thinking on), closed or still open, unless blank."""
        if not self.thinking:
            return None
        reasoning = text.split(THINK_CLOSE, 1)[0]
        return reasoning if reasoning.strip() else None

    def visible_content(self, text: str) -> str:
        """The response channel's text so far (after the think channel closes; up to its close)."""
        if self.thinking:
            if THINK_CLOSE not in text:
                return ""
            text = text.split(THINK_CLOSE, 1)[1]
            text = text[len(RESPONSE_OPEN) :] if text.startswith(RESPONSE_OPEN) else ""
        cut = [i for i in (text.find(CLOSE), text.find(OPEN)) if i >= 0]
        return text[: min(cut)] if cut else text


def chat_format_for(
    config: ModelConfig, tool_format: str = "typescript", special: Mapping[str, int] | None = None
) -> ChatFormat:
    """The chat format a model of ``config`` speaks (module doc); ``tool_format``: K2's declaration style.

    With ``special`` (the tokenizer's special tokens), a K3-family model whose tokenizer lacks the XTML
    tokens speaks K2's format, with a warning: it cannot write K3's markup (a checkpoint trained with a
    plain k2lab tokenizer keeps serving as before; ``chat_k3.with_k3_tokens`` appends the tokens).
    """
    if not is_k3_family(config):
        return K2ChatFormat(tool_format)
    missing = K3ChatFormat().missing_tokens(special) if special is not None else []
    if missing:
        warnings.warn(
            f"a K3-family model whose tokenizer lacks {', '.join(missing)} speaks K2's chat format "
            "(k2lab.runtime.chat_k3.with_k3_tokens appends them after the existing ids)",
            stacklevel=2,
        )
        return K2ChatFormat(tool_format)
    return K3ChatFormat()


def chat_format_of(
    model: object, tool_format: str = "typescript", tokenizer: Tokenizer | None = None
) -> ChatFormat:
    """``chat_format_for`` a model's (text) config and tokenizer; K2's format for an object without a
    ``ModelConfig``."""
    config = getattr(model, "config", None)
    config = getattr(config, "text", config)  # a vision-language model's language model
    if not isinstance(config, ModelConfig):
        return K2ChatFormat(tool_format)
    return chat_format_for(config, tool_format, None if tokenizer is None else tokenizer.special_tokens)
