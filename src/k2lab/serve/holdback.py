"""What of a growing reply can be streamed: the text less what could still change (``settled``).

A streamed delta cannot be taken back, so a text that grows token by token is sent only up to where it is
settled: not its last ``len(stop) - 1`` characters while a stop string could still begin there (the stop
string is cut from the reply once complete), and not a trailing half UTF-8 character (decoded as U+FFFD until
its next byte arrives). Chat completions and ``/v1/completions`` share it, so their streams hold back alike.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["settled"]


def settled(text: str, stops: Sequence[str], floor: int = 0) -> int:
    """Length of the prefix of ``text`` that later tokens can no longer change (at least 0): the text less
    ``max(len(stop)) - 1`` characters, then less trailing U+FFFD characters down to ``floor`` (what was
    already sent)."""
    safe = max(len(text) - max((len(s) - 1 for s in stops if s), default=0), 0)
    while safe > floor and text[safe - 1] == "\ufffd":
        safe -= 1
    return safe
