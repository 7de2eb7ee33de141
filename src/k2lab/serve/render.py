"""A request's chat rendered in the served format, what the format refuses answered as a 400 naming the field."""

from __future__ import annotations

from typing import Any

from k2lab.runtime.chat import ChatFormatError
from k2lab.runtime.chat_format import ChatFormat
from k2lab.serve.errors import APIError

__all__ = ["render_prompt"]


def render_prompt(
    fmt: ChatFormat, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **options: Any
) -> str:
    """``fmt.render_chat(messages, tools=tools, **options)``; 400 naming ``tools`` or ``messages`` for what it
    refuses, and for nesting deeper than its recursion can follow (``$ref`` chains inlined one inside another
    past ``validate_tools``'s depth limit, say: a RecursionError, not a traceback)."""
    try:
        return fmt.render_chat(messages, tools=tools, **options)
    except ChatFormatError as error:  # a message, or the tool declarations ("tools contains ...")
        param = "tools" if str(error).startswith("tools ") else "messages"
        raise APIError(400, str(error), param=param) from error
    except RecursionError:
        param = "tools" if tools else "messages"
        message = f"The {param} nest objects and arrays (and inlined $refs) too deeply to render."
        raise APIError(400, message, param=param) from None
