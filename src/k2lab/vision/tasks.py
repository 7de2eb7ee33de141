"""Synthetic visual tasks drawn locally with Pillow, with exact ground truth, deterministic from a seed.

Each :class:`VisualSample` carries the image, the prompt, the ideal answer text (in the format the parsers of
:mod:`k2lab.vision.rewards` read, so ``visual_reward(kind, answer, truth) == 1.0``) and structured truth:

* ``counting`` — shapes (circle, square, triangle) of palette colours, placed without overlap and with at
  least a 2-pixel gap; "How many red circles?" → ``truth: int``.
* ``grounding_box`` — every object of a named colour and shape → ``truth: list[(x1, y1, x2, y2)]``, the exact
  extent of the drawn pixels in half-open pixel-edge coordinates: ``x1 = min column, x2 = max column + 1``
  (so ``(x2 − x1) · (y2 − y1)`` is the pixel area of the bounding rectangle).
* ``grounding_point`` — the same objects as points → ``truth: list[(cx, cy)]`` with
  ``cx = (x1 + x2) / 2, cy = (y1 + y2) / 2``, the centre of that exact box.
* ``segmentation`` — one polygon shape (triangle, square, pentagon) of a unique colour+shape →
  ``truth: bool ndarray (H, W)``, exactly the pixels ``ImageDraw.polygon`` drew for it; the answer is its
  integer vertex list, which :func:`~k2lab.vision.rewards.polygon_to_mask` rasterises to the same pixels.
* ``ocr`` — a random word or short string in Pillow's default font → ``truth: str``.
* ``chart`` — a bar chart of 3–6 bars with integer values, grid lines every unit, letter labels; either the
  value of a named bar (``truth: float``) or the label of the unique largest bar (``truth: str``). A bar of
  value v is exactly ``v · unit`` pixels tall.

Default sizes are multiples of 28 (patch 14, merge 2), see :data:`DEFAULT_SIZES`; ``size=(W, H)`` overrides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from k2lab.vision.rewards import TASK_KINDS

Size = tuple[int, int]

BACKGROUND = (255, 255, 255)
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 75),
    "green": (60, 180, 75),
    "blue": (0, 90, 200),
    "yellow": (255, 200, 0),
    "purple": (145, 30, 180),
    "orange": (245, 130, 48),
}
COUNT_SHAPES = ("circle", "square", "triangle")
POLYGON_SHAPES = ("triangle", "square", "pentagon")
DEFAULT_SIZES: dict[str, Size] = {
    "counting": (112, 112),
    "grounding_box": (112, 112),
    "grounding_point": (112, 112),
    "segmentation": (84, 84),
    "ocr": (112, 56),
    "chart": (112, 112),
}
GAP = 2  # background pixels kept between any two shapes
WORDS = [
    "kimi",
    "moon",
    "light",
    "vision",
    "token",
    "patch",
    "river",
    "cloud",
    "seven",
    "apple",
    "green",
    "stone",
    "delta",
    "orbit",
    "pixel",
    "tiger",
    "lemon",
    "quartz",
    "maple",
    "echo",
]
OCR_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"
GRID_COLOUR = (215, 215, 215)
AXIS_COLOUR = (40, 40, 40)


@dataclass
class VisualSample:
    """One synthetic task: image, prompt, ideal answer text, kind, structured truth and drawing metadata."""

    image: Image.Image
    prompt: str
    answer: str
    kind: str
    truth: Any
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Shape:
    """A shape inside the inclusive square ``box`` = (x0, y0, x1, y1); polygons carry integer vertices."""

    kind: str
    colour: str
    box: tuple[int, int, int, int]
    vertices: tuple[tuple[int, int], ...] = ()


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def _rng(rng_or_seed: int | np.random.Generator | None) -> np.random.Generator:
    if isinstance(rng_or_seed, np.random.Generator):
        return rng_or_seed
    return np.random.default_rng(rng_or_seed)


def _pick(rng: np.random.Generator, seq: Sequence[Any]) -> Any:
    return seq[int(rng.integers(len(seq)))]


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _json(items: Sequence[Sequence[float]]) -> str:
    return "[" + ", ".join("[" + ", ".join(_fmt(v) for v in item) + "]" for item in items) + "]"


def _check_size(size: Sequence[int]) -> Size:
    width, height = int(size[0]), int(size[1])
    if width < 28 or height < 28:
        raise ValueError(f"image size must be at least 28x28, got {width}x{height}")
    return width, height


def _plural(shape: str) -> str:
    return shape + "s"


def _default_font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ValueError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


# ----------------------------------------------------------------------------------------------------------
# Shapes: geometry, drawing and exact masks
# ----------------------------------------------------------------------------------------------------------


def _regular_vertices(
    box: tuple[int, int, int, int], sides: int, angle: float
) -> tuple[tuple[int, int], ...]:
    x0, y0, x1, y1 = box
    cx, cy, r = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2
    points = []
    for k in range(sides):
        theta = angle + 2 * math.pi * k / sides
        x = min(x1, max(x0, round(cx + r * math.cos(theta))))
        y = min(y1, max(y0, round(cy + r * math.sin(theta))))
        points.append((x, y))
    return tuple(points)


def _vertices(
    kind: str, box: tuple[int, int, int, int], rng: np.random.Generator
) -> tuple[tuple[int, int], ...]:
    x0, y0, x1, y1 = box
    if kind == "square":
        return ((x0, y0), (x1, y0), (x1, y1), (x0, y1))
    if kind == "triangle":
        apex = int(rng.integers(x0 + (x1 - x0) // 4, x1 - (x1 - x0) // 4 + 1))
        return ((apex, y0), (x1, y1), (x0, y1))
    if kind == "pentagon":
        return _regular_vertices(box, 5, -math.pi / 2 + float(rng.uniform(-0.3, 0.3)))
    return ()  # circle


def draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, fill: Any) -> None:
    """Draw ``shape`` filled with ``fill``: circles with ``ellipse``, everything else with ``polygon``."""
    if shape.kind == "circle":
        draw.ellipse(shape.box, fill=fill)
    else:
        draw.polygon(list(shape.vertices), fill=fill)


def shape_mask(shape: Shape, size: Size) -> np.ndarray:
    """Exactly the pixels :func:`draw_shape` covers for ``shape`` on a ``size = (W, H)`` canvas, (H, W) bool."""
    canvas = Image.new("L", size, 0)
    draw_shape(ImageDraw.Draw(canvas), shape, 255)
    return np.asarray(canvas) > 0


def mask_box(mask: np.ndarray) -> tuple[int, int, int, int]:
    """Half-open extent (x1, y1, x2, y2) of a non-empty mask: min column/row and max column/row + 1."""
    rows, cols = np.nonzero(mask)
    return int(cols.min()), int(rows.min()), int(cols.max()) + 1, int(rows.max()) + 1


def _place(
    rng: np.random.Generator,
    size: Size,
    taken: list[tuple[int, int, int, int]],
    min_side: int,
    max_side: int,
    attempts: int = 60,
) -> tuple[int, int, int, int] | None:
    """An inclusive square box inside the image, at least GAP pixels from every taken box, or None."""
    width, height = size
    for _ in range(attempts):
        side = int(rng.integers(min_side, max_side + 1))
        if side + 2 >= min(width, height):
            continue
        x0 = int(rng.integers(1, width - side - 1))
        y0 = int(rng.integers(1, height - side - 1))
        box = (x0, y0, x0 + side, y0 + side)
        if all(_apart(box, other) for other in taken):
            return box
    return None


def _apart(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[2] + GAP < b[0] or b[2] + GAP < a[0] or a[3] + GAP < b[1] or b[3] + GAP < a[1]


def _side_range(size: Size) -> tuple[int, int]:
    short = min(size)
    return max(7, short // 10), max(9, short // 5)


def _scene(
    rng: np.random.Generator,
    size: Size,
    specs: Sequence[tuple[str, str]],
) -> list[Shape]:
    """Place shapes for ``specs`` = [(kind, colour), ...] in order; specs that do not fit are skipped."""
    lo, hi = _side_range(size)
    shapes: list[Shape] = []
    for kind, colour in specs:
        box = _place(rng, size, [s.box for s in shapes], lo, hi)
        if box is not None:
            shapes.append(Shape(kind, colour, box, _vertices(kind, box, rng)))
    return shapes


def render_scene(shapes: Sequence[Shape], size: Size) -> Image.Image:
    image = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        draw_shape(draw, shape, PALETTE[shape.colour])
    return image


def _shape_meta(shapes: Sequence[Shape]) -> list[dict[str, Any]]:
    return [{"kind": s.kind, "colour": s.colour, "box": s.box, "vertices": s.vertices} for s in shapes]


def _random_specs(
    rng: np.random.Generator, n: int, kinds: Sequence[str], exclude: tuple[str, str] | None = None
) -> list[tuple[str, str]]:
    specs = []
    while len(specs) < n:
        spec = (_pick(rng, kinds), _pick(rng, list(PALETTE)))
        if spec != exclude:
            specs.append(spec)
    return specs


# ----------------------------------------------------------------------------------------------------------
# Generators
# ----------------------------------------------------------------------------------------------------------


def counting_task(rng: np.random.Generator, size: Size, max_shapes: int = 8) -> VisualSample:
    """Count all shapes, or those of a colour, a kind, or both; truth is the exact count of placed shapes."""
    n = int(rng.integers(1, max_shapes + 1))
    shapes = _scene(rng, size, _random_specs(rng, n, COUNT_SHAPES))
    reference = _pick(rng, shapes)
    mode = _pick(rng, ("all", "colour", "kind", "both"))
    colour = reference.colour if mode in ("colour", "both") else None
    kind = reference.kind if mode in ("kind", "both") else None
    if rng.random() < 0.15 and mode != "all":  # sometimes ask about something that may be absent
        colour = _pick(rng, list(PALETTE)) if colour else None
        kind = _pick(rng, COUNT_SHAPES) if kind else None
    count = sum((colour is None or s.colour == colour) and (kind is None or s.kind == kind) for s in shapes)
    noun = _plural(kind) if kind else "shapes"
    subject = f"{colour} {noun}" if colour else noun
    prompt = f"How many {subject} are in the image? Answer with a single number."
    meta = {"shapes": _shape_meta(shapes), "colour": colour, "shape": kind}
    return VisualSample(render_scene(shapes, size), prompt, str(count), "counting", count, meta)


def _grounding_scene(rng: np.random.Generator, size: Size) -> tuple[list[Shape], list[Shape], str, str]:
    kind, colour = _pick(rng, COUNT_SHAPES), _pick(rng, list(PALETTE))
    n_targets, n_others = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    specs = [(kind, colour)] * n_targets + _random_specs(rng, n_others, COUNT_SHAPES, (kind, colour))
    shapes = _scene(rng, size, specs)
    if not any(s.kind == kind and s.colour == colour for s in shapes):  # the first spec always fits
        raise RuntimeError("could not place the target shape")
    targets = [s for s in shapes if s.kind == kind and s.colour == colour]
    return shapes, targets, kind, colour


def grounding_box_task(rng: np.random.Generator, size: Size) -> VisualSample:
    """Boxes of every ``colour kind``; truth boxes are the exact half-open extents of the drawn pixels."""
    shapes, targets, kind, colour = _grounding_scene(rng, size)
    boxes = [mask_box(shape_mask(s, size)) for s in targets]
    prompt = (
        f"Locate every {colour} {kind} in the image. Output the bounding boxes in pixels as "
        "[[x1, y1, x2, y2], ...]."
    )
    meta = {"shapes": _shape_meta(shapes), "colour": colour, "shape": kind}
    return VisualSample(render_scene(shapes, size), prompt, _json(boxes), "grounding_box", boxes, meta)


def grounding_point_task(rng: np.random.Generator, size: Size) -> VisualSample:
    """Centres of every ``colour kind``: the centre ((x1 + x2) / 2, (y1 + y2) / 2) of each exact box."""
    shapes, targets, kind, colour = _grounding_scene(rng, size)
    points = []
    for s in targets:
        x1, y1, x2, y2 = mask_box(shape_mask(s, size))
        points.append(((x1 + x2) / 2, (y1 + y2) / 2))
    prompt = (
        f"Point to the centre of every {colour} {kind} in the image. Output pixel points as [[x, y], ...]."
    )
    meta = {"shapes": _shape_meta(shapes), "colour": colour, "shape": kind}
    return VisualSample(render_scene(shapes, size), prompt, _json(points), "grounding_point", points, meta)


def segmentation_task(rng: np.random.Generator, size: Size) -> VisualSample:
    """The mask of one polygon shape with a unique colour+kind; the answer is its vertex list."""
    kind, colour = _pick(rng, POLYGON_SHAPES), _pick(rng, list(PALETTE))
    others = _random_specs(rng, int(rng.integers(0, 4)), COUNT_SHAPES + ("pentagon",), (kind, colour))
    shapes = _scene(rng, size, [(kind, colour), *others])
    target = shapes[0]
    if (target.kind, target.colour) != (kind, colour):  # the first spec always fits an empty canvas
        raise RuntimeError("could not place the target shape")
    mask = shape_mask(target, size)
    prompt = f"Segment the {colour} {kind}. Output its outline as a polygon of pixel vertices [[x, y], ...]."
    meta = {"shapes": _shape_meta(shapes), "colour": colour, "shape": kind, "target": 0}
    return VisualSample(
        render_scene(shapes, size), prompt, _json(target.vertices), "segmentation", mask, meta
    )


def ocr_task(rng: np.random.Generator, size: Size) -> VisualSample:
    """A random word (or short random string) in Pillow's default font, as large as fits."""
    if rng.random() < 0.5:
        text = _pick(rng, WORDS)
    else:
        text = "".join(_pick(rng, OCR_ALPHABET) for _ in range(int(rng.integers(3, 8))))
    width, height = size
    image = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    font, bbox = _default_font(10), (0, 0, 0, 0)
    for font_size in range(min(40, height - 4), 9, -1):
        font = _default_font(font_size)
        bbox = draw.textbbox((0, 0), text, font=font)
        if bbox[2] - bbox[0] <= width - 4 and bbox[3] - bbox[1] <= height - 4:
            break
    x = (width - (bbox[2] - bbox[0])) // 2 - bbox[0]
    y = (height - (bbox[3] - bbox[1])) // 2 - bbox[1]
    colour = tuple(int(c) for c in rng.integers(0, 90, size=3))
    draw.text((x, y), text, fill=colour, font=font)
    prompt = "Read the text in the image. Answer with the text only."
    meta = {"font_size": getattr(font, "size", None), "origin": (x, y), "colour": colour}
    return VisualSample(image, prompt, text, "ocr", text, meta)


def chart_task(rng: np.random.Generator, size: Size, max_value: int = 9) -> VisualSample:
    """A bar chart with integer values 1…max_value, one grid line per unit, letter labels under the bars."""
    width, height = size
    n = int(rng.integers(3, 7))
    labels = sorted(str(c) for c in rng.choice(list("ABCDEFGHJKLMNPRSTUVWXYZ"), size=n, replace=False))
    values = [int(v) for v in rng.integers(1, max_value + 1, size=n)]
    colours = [str(c) for c in rng.choice(list(PALETTE), size=n, replace=False)]
    label_band, top, margin = max(12, height // 8), 3, 3
    baseline = height - label_band
    unit = (baseline - top) // max_value
    if unit < 1 or (width - 2 * margin) // n < 3:
        raise ValueError(f"image {width}x{height} too small for a {n}-bar chart")
    image = Image.new("RGB", size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    for k in range(1, max_value + 1):
        draw.line([(0, baseline - k * unit), (width - 1, baseline - k * unit)], fill=GRID_COLOUR)
    slot = (width - 2 * margin) // n
    bar_width = max(2, slot * 2 // 3)
    font = _label_font(draw, labels, baseline + 2, height)
    bars = []
    for i, (label, value, colour) in enumerate(zip(labels, values, colours, strict=True)):
        x0 = margin + i * slot + (slot - bar_width) // 2
        x1 = x0 + bar_width - 1
        draw.rectangle([x0, baseline - value * unit, x1, baseline - 1], fill=PALETTE[colour])
        draw.text(((x0 + x1 + 1) / 2, baseline + 2), label, fill=AXIS_COLOUR, font=font, anchor="mt")
        bars.append({"label": label, "value": value, "colour": colour, "x": (x0, x1)})
    draw.line([(0, baseline), (width - 1, baseline)], fill=AXIS_COLOUR)
    meta = {"bars": bars, "unit": unit, "baseline": baseline}
    largest = max(values)
    if values.count(largest) == 1 and rng.random() < 0.4:
        label = labels[values.index(largest)]
        prompt = "In the bar chart, which bar is the largest? Answer with its label."
        return VisualSample(image, prompt, label, "chart", label, meta)
    index = int(rng.integers(n))
    prompt = (
        f"In the bar chart, grid lines are one unit apart. What is the value of bar {labels[index]}? "
        "Answer with a number."
    )
    return VisualSample(image, prompt, str(values[index]), "chart", float(values[index]), meta)


def _label_font(
    draw: ImageDraw.ImageDraw, labels: Sequence[str], top: int, height: int
) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """The largest default font (≤ 16 px) whose labels, hung from row ``top``, end inside the image."""
    for font_size in range(16, 5, -1):
        font = _default_font(font_size)
        if all(draw.textbbox((0, top), label, font=font, anchor="mt")[3] <= height for label in labels):
            return font
    return _default_font(6)


_GENERATORS = {
    "counting": counting_task,
    "grounding_box": grounding_box_task,
    "grounding_point": grounding_point_task,
    "segmentation": segmentation_task,
    "ocr": ocr_task,
    "chart": chart_task,
}


def make_task(kind: str, rng_or_seed: int | np.random.Generator | None = None, **opts: Any) -> VisualSample:
    """One sample of ``kind`` (one of TASK_KINDS); ``size=(W, H)`` and generator options pass through."""
    if kind not in _GENERATORS:
        raise ValueError(f"unknown visual task kind {kind!r}; expected one of {TASK_KINDS}")
    size = _check_size(opts.pop("size", DEFAULT_SIZES[kind]))
    return _GENERATORS[kind](_rng(rng_or_seed), size, **opts)


def generate_tasks(
    n: int, kinds: Sequence[str] = TASK_KINDS, seed: int = 0, size: Size | None = None
) -> list[VisualSample]:
    """``n`` samples cycling through ``kinds`` (so every kind appears once n ≥ len(kinds)) in a seeded
    shuffled order; sample i is drawn from its own generator seeded from ``seed``, so output is deterministic."""
    if not kinds:
        raise ValueError("kinds must not be empty")
    rng = np.random.default_rng(seed)
    order = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(order)
    seeds = rng.integers(0, 2**63 - 1, size=n)
    opts = {} if size is None else {"size": size}
    return [make_task(kind, int(s), **opts) for kind, s in zip(order, seeds, strict=True)]


__all__ = [
    "DEFAULT_SIZES",
    "PALETTE",
    "Shape",
    "VisualSample",
    "draw_shape",
    "generate_tasks",
    "make_task",
    "mask_box",
    "render_scene",
    "shape_mask",
]
