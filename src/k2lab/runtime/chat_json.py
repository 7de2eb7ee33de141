"""Strict JSON for tool-call arguments: what every JSON parser accepts, nothing more.

Python's ``json.loads`` takes ``NaN``, ``Infinity`` and ``-Infinity`` (and reads ``1e999`` as infinity,
which ``json.dumps`` then writes as ``Infinity``); strict parsers (JavaScript's ``JSON.parse``, most
OpenAI clients) reject them. The chat formats read arguments with ``loads_strict``, so such arguments are
refused where they are rendered or parsed instead of reaching a client as text it cannot read.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["loads_strict"]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (strict JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} is too large for a double (it would read as Infinity)")
    return value


def loads_strict(text: str | bytes) -> Any:
    """``json.loads(text)`` raising ``ValueError`` for ``NaN``, ``Infinity``, ``-Infinity`` and numbers that
    overflow a double, as it does for any other text that is not JSON."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
