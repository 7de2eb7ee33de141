"""A visual task's final answer line, written so that ``visual_reward`` scores the whole reply by it.

A reply that reasons first (a program and its output, or a visual chain of thought) ends with

    Answer: {value}

in a form each parser of ``k2lab.vision.rewards`` finds even after other numbers and arrays:

==================  ============================================  =====================================
kind                value                                         why
==================  ============================================  =====================================
counting            ``3``                                         ``parse_count``: the last ``Answer: N``
chart               ``7`` or the bar's label ``B``                ``parse_number`` / ``answer: X`` wins
grounding_box       ``<box>x1,y1,x2,y2</box>`` per box            tags win over any JSON array
grounding_point     ``<point>x,y</point>`` per point              tags win over any JSON array
segmentation        ``<polygon>x1,y1,x2,y2,...</polygon>``        tags win over any JSON array
ocr                 the text                                      ``parse_text``: after the last
==================  ============================================  =====================================

Every kind, OCR included (its text is what follows the last ``Answer:``, ``parse_text``), scores 1.0 on the
whole reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from k2lab.vision.tasks import VisualSample

__all__ = ["ANSWER_PREFIX", "final_answer", "sample_answer_value"]

ANSWER_PREFIX = "Answer: "


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _tags(tag: str, items: Sequence[Sequence[float]]) -> str:
    return "".join(f"<{tag}>" + ",".join(_number(v) for v in item) + f"</{tag}>" for item in items)


def final_answer(kind: str, value: Any) -> str:
    """``"Answer: ..."`` for ``kind`` (a ``TASK_KINDS`` entry) and ``value``: a count, a list of boxes or
    points, a polygon's vertices, a text, or a chart's number or label."""
    if kind in ("counting", "chart"):
        text = value if isinstance(value, str) else _number(value)
    elif kind == "grounding_box":
        text = _tags("box", value)
    elif kind == "grounding_point":
        text = _tags("point", value)
    elif kind == "segmentation":
        text = "<polygon>" + ",".join(_number(c) for vertex in value for c in vertex) + "</polygon>"
    elif kind == "ocr":
        text = str(value)
    else:
        raise ValueError(f"unknown visual task kind {kind!r}")
    return ANSWER_PREFIX + text


def sample_answer_value(sample: VisualSample) -> Any:
    """What ``final_answer`` takes for a synthetic task: its truth, or for segmentation the target's
    vertices (the truth there is the drawn mask)."""
    if sample.kind == "segmentation":
        return sample.meta["shapes"][sample.meta["target"]]["vertices"]
    return sample.truth
