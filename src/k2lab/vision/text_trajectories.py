"""K2.5's zero-vision SFT data: perceptual questions about a scene given as text, answered by a program.

After joint vision-text pre-training, K2.5's SFT uses text trajectories only: IPython operations in text
turn perceptual questions into programmatic actions, and the cross-modal representations of pre-training
carry those actions over to images. Each trajectory here asks the question of a synthetic visual task
(``k2lab.vision.tasks``: counting, grounding boxes and points, segmentation, OCR, charts) about the
task's scene written as Python data, and answers with a short program over it, its printed output and the
answer line (``k2lab.vision.answers.final_answer``)::

    user:      The image is given as text ... ```python\\nobjects = [("red", "circle", [12, 30, 25, 43]), ...]\\n```
               How many red circles are in the image? Answer with a single number.
    assistant: I work it out from the description with Python.
               ```python\\nprint(sum(1 for colour, shape, box in objects if ...))\\n```
               ```output\\n2\\n```
               Answer: 2

The scenes are the tasks' own (the same seeds draw the same image): boxes are the exact pixel extents of
the drawn shapes (half-open), outlines the polygons' vertices, OCR a shuffled list of the characters with
their x positions, charts the bars' top rows with the baseline and the grid's pixels per unit. The program
is run (``exec``) to print its output, and the answer is read from that output, so a trajectory's answer
is what its program computes. Deterministic from ``seed``; ``write_zero_vision`` writes the JSONL that
``k2lab sft`` reads (``{"messages": [...], "task": kind}``).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from k2lab.fsutil import atomic_write_text, check_output_file, make_directory
from k2lab.train.sections import check_task_kinds
from k2lab.vision.answers import final_answer
from k2lab.vision.rewards import TASK_KINDS
from k2lab.vision.tasks import Shape, VisualSample, generate_tasks, mask_box, shape_mask

__all__ = [
    "TextTrajectory",
    "ZeroVisionConfig",
    "run_program",
    "scene_program",
    "write_zero_vision",
    "zero_vision_trajectories",
]

OBJECTS_INTRO = (
    "The image is given as text: its objects as (colour, shape, pixel box [x1, y1, x2, y2]), the box's right "
    "and bottom edges exclusive."
)
OUTLINES_INTRO = (
    "The image is given as text: its objects as (colour, shape, outline), the outline a polygon's pixel "
    "vertices (a circle's: the corners of its box)."
)
OCR_INTRO = "The image is given as text: each character drawn, with the pixel column where it starts."
CHART_INTRO = (
    "The image is given as text: each bar as (label, pixel row of its top), the bars standing on row "
    "`baseline`, the grid lines `unit` pixels apart."
)
REPLY_INTRO = "I work it out from the description with Python."


class ZeroVisionConfig(BaseModel):
    """What ``k2lab data zero-vision`` writes: ``count`` trajectories drawn from ``seed``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    out: Path = Field(description="Output JSONL file (k2lab sft --data reads it).")
    count: int = Field(default=1000, ge=1, description="Trajectories to write.")
    seed: int = Field(default=0, ge=0, description="Seed of the scenes (the same seed writes the same file).")
    tasks: tuple[str, ...] = Field(default=TASK_KINDS, description="Visual task kinds, cycled.")

    def model_post_init(self, _context: object) -> None:
        check_task_kinds("tasks", self.tasks)


@dataclass
class TextTrajectory:
    """One conversation and the visual task it was made from (whose ``truth`` its answer must match)."""

    sample: VisualSample
    messages: list[dict[str, str]]

    def record(self) -> dict[str, Any]:
        return {"messages": self.messages, "task": self.sample.kind}


def _extent(shape: dict[str, Any], size: tuple[int, int]) -> list[int]:
    """The exact half-open pixel box of a drawn shape (as the grounding tasks' truth)."""
    return list(
        mask_box(shape_mask(Shape(shape["kind"], shape["colour"], shape["box"], shape["vertices"]), size))
    )


def _objects(rows: Sequence[tuple[str, str, Any]]) -> str:
    return (
        "objects = [\n"
        + "".join(f"    ({json.dumps(c)}, {json.dumps(k)}, {json.dumps(v)}),\n" for c, k, v in rows)
        + "]"
    )


def _match(colour: str | None, shape: str | None) -> str:
    tests = [
        f"colour == {json.dumps(colour)}" if colour else "",
        f"shape == {json.dumps(shape)}" if shape else "",
    ]
    return " and ".join(t for t in tests if t) or "True"


def scene_program(sample: VisualSample) -> tuple[str, str, str]:
    """(intro, the scene as Python data, the program that prints the answer) of a synthetic task."""
    kind, meta, size = sample.kind, sample.meta, sample.image.size
    if kind in ("counting", "grounding_box", "grounding_point"):
        scene = _objects([(s["colour"], s["kind"], _extent(s, size)) for s in meta["shapes"]])
        chosen = f"[box for colour, shape, box in objects if {_match(meta['colour'], meta['shape'])}]"
        if kind == "counting":
            return OBJECTS_INTRO, scene, f"print(len({chosen}))"
        if kind == "grounding_box":
            return OBJECTS_INTRO, scene, f"print({chosen})"
        program = f"boxes = {chosen}\nprint([[(x1 + x2) / 2, (y1 + y2) / 2] for x1, y1, x2, y2 in boxes])"
        return OBJECTS_INTRO, scene, program
    if kind == "segmentation":
        rows = []
        for s in meta["shapes"]:
            x0, y0, x1, y1 = s["box"]
            outline = s["vertices"] or ((x0, y0), (x1, y0), (x1, y1), (x0, y1))
            rows.append((s["colour"], s["kind"], [list(v) for v in outline]))
        program = f"print(next(outline for colour, shape, outline in objects if {_match(meta['colour'], meta['shape'])}))"
        return OUTLINES_INTRO, _objects(rows), program
    if kind == "ocr":
        return (
            OCR_INTRO,
            _glyphs(sample),
            'print("".join(char for char, x in sorted(glyphs, key=lambda g: g[1])))',
        )
    bars = meta["bars"]
    tops = [(b["label"], meta["baseline"] - b["value"] * meta["unit"]) for b in bars]
    scene = f"bars = {json.dumps(tops)}\nbaseline = {meta['baseline']}\nunit = {meta['unit']}"
    if isinstance(sample.truth, str):
        return CHART_INTRO, scene, "print(min(bars, key=lambda bar: bar[1])[0])"
    label = sample.prompt.split("value of bar ")[1].split("?")[0]
    return CHART_INTRO, scene, f"top = dict(bars)[{json.dumps(label)}]\nprint((baseline - top) // unit)"


def _glyphs(sample: VisualSample) -> str:
    """The OCR text's characters with start columns (an even advance from the drawn origin), shuffled by a
    generator seeded from the text, so the order in the description gives no hint."""
    text, meta = sample.truth, sample.meta
    advance = max(1, int(meta["font_size"] or 10) * 3 // 5)
    glyphs = [(char, int(meta["origin"][0]) + i * advance) for i, char in enumerate(text)]
    order = np.random.default_rng(sum(map(ord, text))).permutation(len(glyphs))
    return "glyphs = " + json.dumps([glyphs[i] for i in order])


def run_program(scene: str, program: str) -> str:
    """What ``program`` prints, run after ``scene`` (both generated here, never user input)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(scene + "\n" + program, "<trajectory>", "exec"), {})  # noqa: S102 - our own code
    return out.getvalue().strip()


def _value(kind: str, output: str) -> Any:
    """The printed output as ``final_answer``'s value: the text itself for OCR and a chart's label."""
    if kind == "ocr":
        return output
    try:
        return ast.literal_eval(output)
    except (ValueError, SyntaxError):
        return output


def trajectory(sample: VisualSample) -> TextTrajectory:
    """The zero-vision conversation of one synthetic task."""
    intro, scene, program = scene_program(sample)
    output = run_program(scene, program)
    question = f"{intro}\n```python\n{scene}\n```\n{sample.prompt}"
    reply = f"{REPLY_INTRO}\n```python\n{program}\n```\n```output\n{output}\n```\n" + final_answer(
        sample.kind, _value(sample.kind, output)
    )
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    return TextTrajectory(sample, messages)


def zero_vision_trajectories(
    count: int, seed: int = 0, tasks: Sequence[str] = TASK_KINDS
) -> list[TextTrajectory]:
    """``count`` trajectories over ``tasks`` (cycled, in ``generate_tasks``' seeded order)."""
    return [trajectory(sample) for sample in generate_tasks(count, kinds=tuple(tasks), seed=seed)]


def write_zero_vision(config: ZeroVisionConfig) -> Path:
    """Write ``config.count`` trajectories to ``config.out`` (one JSON conversation a line), replacing it
    atomically; a directory or an unwritable place is refused in one line before any work."""
    what = "zero-vision trajectories"
    check_output_file(config.out, what)
    lines = [
        json.dumps(t.record()) + "\n"
        for t in zero_vision_trajectories(config.count, config.seed, config.tasks)
    ]
    make_directory(config.out.parent, f"the folder of the {what}")
    atomic_write_text(config.out, "".join(lines))
    return config.out
