"""What of a growing reply a stream may send (``k2lab.serve.holdback.settled``), by hand from its rule."""

from __future__ import annotations

from k2lab.serve.holdback import settled


def test_a_trailing_half_utf8_character_is_held_back():
    """A byte sequence cut mid-character decodes to a trailing U+FFFD until its next byte: not sent."""
    assert settled("ab\ufffd", []) == 2
    assert settled("ab\ufffd\ufffd", []) == 2
    assert settled("a\ufffdb", []) == 3  # a U+FFFD inside the text is settled
    assert settled("ab\ufffd", [], floor=3) == 3  # what was sent stays sent


def test_the_tail_that_could_begin_a_stop_string_is_held_back():
    assert settled("hello", ["llo!"]) == 2  # len(stop) - 1 = 3 characters held
    assert settled("hello", ["x", "abc"]) == 3  # the longest stop string decides
    assert settled("hi", ["abcdef"]) == 0
