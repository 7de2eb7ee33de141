"""Type tests for values read from a checkpoint's JSON config: JSON has no separate boolean-free integer,
and Python's ``bool`` is an ``int``, so ``true`` must not pass as a size or a number."""

from __future__ import annotations

from typing import Any

__all__ = ["is_integer", "is_number"]


def is_integer(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)
