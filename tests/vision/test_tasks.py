"""Synthetic visual tasks: determinism, exact ground truth checked against the pixels, ideal answers score 1."""

from __future__ import annotations

import numpy as np
import pytest

from k2lab.vision.rewards import (
    TASK_KINDS,
    parse_boxes,
    parse_count,
    parse_points,
    parse_polygon,
    polygon_to_mask,
    visual_reward,
)
from k2lab.vision.tasks import (
    DEFAULT_SIZES,
    PALETTE,
    Shape,
    VisualSample,
    generate_tasks,
    make_task,
    mask_box,
    shape_mask,
)

WHITE = np.array([255, 255, 255])
SEEDS = range(6)


def pixels(sample: VisualSample) -> np.ndarray:
    return np.asarray(sample.image.convert("RGB")).astype(int)


def colour_mask(sample: VisualSample, colour: str) -> np.ndarray:
    return (pixels(sample) == np.array(PALETTE[colour])).all(-1)


def components(foreground: np.ndarray) -> list[np.ndarray]:
    """8-connected components of a boolean image, each as a boolean mask (flood fill with a stack)."""
    seen = np.zeros_like(foreground, dtype=bool)
    height, width = foreground.shape
    found = []
    for start in zip(*np.nonzero(foreground), strict=True):
        if seen[start]:
            continue
        mask = np.zeros_like(seen)
        stack = [start]
        seen[start] = True
        while stack:
            y, x = stack.pop()
            mask[y, x] = True
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < height and 0 <= nx < width and foreground[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        stack.append((ny, nx))
        found.append(mask)
    return found


def classify(mask: np.ndarray) -> str:
    """Shape kind from how much of its bounding box a blob fills: square 1, circle ≈ π/4, triangle ≈ 1/2."""
    x1, y1, x2, y2 = mask_box(mask)
    fill = mask.sum() / ((x2 - x1) * (y2 - y1))
    return "square" if fill > 0.97 else "circle" if fill > 0.68 else "triangle"


def scene_objects(sample: VisualSample) -> list[tuple[str, str, np.ndarray]]:
    """(colour, kind, mask) of every non-background blob, read from the pixels alone."""
    image = pixels(sample)
    by_rgb = {v: k for k, v in PALETTE.items()}
    objects = []
    for mask in components(~(image == WHITE).all(-1)):
        ys, xs = np.nonzero(mask)
        rgb = {tuple(int(c) for c in image[y, x]) for y, x in zip(ys, xs, strict=True)}
        assert len(rgb) == 1, "a shape is a single flat colour"
        objects.append((by_rgb[rgb.pop()], classify(mask), mask))
    return objects


def assert_same(a: VisualSample, b: VisualSample) -> None:
    assert (a.kind, a.prompt, a.answer, a.image.size) == (b.kind, b.prompt, b.answer, b.image.size)
    assert a.image.tobytes() == b.image.tobytes()
    if isinstance(a.truth, np.ndarray):
        np.testing.assert_array_equal(a.truth, b.truth)
    else:
        assert a.truth == b.truth


def test_generate_tasks_is_deterministic_and_covers_every_kind():
    first, second = generate_tasks(12, seed=7), generate_tasks(12, seed=7)
    for a, b in zip(first, second, strict=True):
        assert_same(a, b)
    assert {s.kind for s in first} == set(TASK_KINDS)
    assert [s.kind for s in first].count("ocr") == 2  # round-robin mixture, then shuffled
    other = generate_tasks(12, seed=8)
    assert any(a.image.tobytes() != b.image.tobytes() for a, b in zip(first, other, strict=True))
    assert {s.kind for s in generate_tasks(4, kinds=("ocr", "chart"), seed=1)} == {"ocr", "chart"}


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_make_task_is_deterministic_and_sized(kind):
    assert_same(make_task(kind, 3), make_task(kind, np.random.default_rng(3)))
    sample = make_task(kind, 0)
    width, height = DEFAULT_SIZES[kind]
    assert sample.image.size == (width, height) and width % 28 == 0 and height % 28 == 0
    assert sample.image.mode == "RGB" and sample.kind == kind
    assert make_task(kind, 0, size=(140, 84)).image.size == (140, 84)
    with pytest.raises(ValueError, match="at least 28x28"):
        make_task(kind, 0, size=(20, 56))


@pytest.mark.parametrize("kind", TASK_KINDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_ideal_answer_scores_one(kind, seed):
    sample = make_task(kind, seed)
    assert visual_reward(kind, sample.answer, sample.truth) == 1.0
    assert visual_reward(kind, f"  {sample.answer}\n", sample.truth) == 1.0


@pytest.mark.parametrize("seed", SEEDS)
def test_counting_truth_matches_the_pixels(seed):
    sample = make_task("counting", seed)
    objects = scene_objects(sample)
    assert len(objects) == len(sample.meta["shapes"])
    assert sorted((c, k) for c, k, _ in objects) == sorted(
        (s["colour"], s["kind"]) for s in sample.meta["shapes"]
    )
    colour, kind = sample.meta["colour"], sample.meta["shape"]
    expected = sum((colour is None or c == colour) and (kind is None or k == kind) for c, k, _ in objects)
    assert sample.truth == expected == parse_count(sample.answer)
    assert sample.prompt.startswith("How many ")


@pytest.mark.parametrize("seed", SEEDS)
def test_grounding_truth_is_the_exact_drawn_extent(seed):
    boxes = make_task("grounding_box", seed)
    points = make_task("grounding_point", seed)
    for sample in (boxes, points):  # same scene stream for the same seed
        assert sample.meta["shapes"] == boxes.meta["shapes"]
    colour, kind = boxes.meta["colour"], boxes.meta["shape"]
    assert f"{colour} {kind}" in boxes.prompt
    extents = sorted(mask_box(m) for c, k, m in scene_objects(boxes) if (c, k) == (colour, kind))
    assert sorted(boxes.truth) == extents and len(extents) >= 1
    assert sorted(parse_boxes(boxes.answer)) == extents
    centres = sorted(((x1 + x2) / 2, (y1 + y2) / 2) for x1, y1, x2, y2 in extents)
    assert sorted(points.truth) == centres == sorted(parse_points(points.answer))


@pytest.mark.parametrize("seed", SEEDS)
def test_segmentation_mask_is_the_drawn_pixels(seed):
    sample = make_task("segmentation", seed)
    width, height = sample.image.size
    mask = sample.truth
    assert mask.dtype == bool and mask.shape == (height, width) and mask.any()
    target = sample.meta["shapes"][sample.meta["target"]]
    x0, y0, x1, y1 = target["box"]
    in_box = np.zeros_like(mask)
    in_box[y0 : y1 + 1, x0 : x1 + 1] = True
    np.testing.assert_array_equal(mask, colour_mask(sample, target["colour"]) & in_box)
    assert not (mask & ~in_box).any()
    # The target is the one blob of its colour and kind, and the answer polygon rasterises to it exactly.
    matches = [m for c, k, m in scene_objects(sample) if c == target["colour"] and (m & mask).any()]
    assert len(matches) == 1 and (matches[0] == mask).all()
    np.testing.assert_array_equal(polygon_to_mask(parse_polygon(sample.answer), (width, height)), mask)


def test_shape_mask_matches_the_rendered_scene():
    shape = Shape("circle", "red", (3, 4, 15, 16))
    mask = shape_mask(shape, (28, 28))
    assert mask_box(mask) == (3, 4, 16, 17)  # half-open: the ellipse touches columns 3..15, rows 4..16


@pytest.mark.parametrize("seed", SEEDS)
def test_ocr_text_is_rendered_inside_the_image(seed):
    sample = make_task("ocr", seed)
    assert sample.truth == sample.answer and 3 <= len(sample.truth) <= 7
    ink = (pixels(sample) < 200).any(-1)
    ys, xs = np.nonzero(ink)
    width, height = sample.image.size
    assert ink.sum() > 20
    assert xs.min() >= 1 and ys.min() >= 1 and xs.max() <= width - 2 and ys.max() <= height - 2


@pytest.mark.parametrize("seed", range(10))
def test_chart_bars_are_exactly_value_times_unit(seed):
    sample = make_task("chart", seed)
    bars, unit = sample.meta["bars"], sample.meta["unit"]
    assert 3 <= len(bars) <= 6
    for bar in bars:
        x0, x1 = bar["x"]
        column = colour_mask(sample, bar["colour"])[:, (x0 + x1) // 2]
        assert column.sum() == bar["value"] * unit
        assert colour_mask(sample, bar["colour"]).sum() == bar["value"] * unit * (x1 - x0 + 1)
    values = [b["value"] for b in bars]
    if isinstance(sample.truth, str):
        assert values.count(max(values)) == 1
        assert sample.truth == bars[values.index(max(values))]["label"] and "largest" in sample.prompt
    else:
        (bar,) = [b for b in bars if f"bar {b['label']}?" in sample.prompt]
        assert sample.truth == float(bar["value"])


def test_both_chart_questions_occur():
    truths = [make_task("chart", seed).truth for seed in range(20)]
    assert any(isinstance(t, str) for t in truths) and any(isinstance(t, float) for t in truths)
