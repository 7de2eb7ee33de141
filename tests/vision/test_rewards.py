"""Visual RL rewards of K2.5: hand-computed cases, optimal matching, parsers, and malformed output → 0."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k2lab.vision.rewards import (
    TASK_KINDS,
    absolute_count_error,
    box_iou,
    chart_reward,
    count_reward,
    mask_iou,
    max_weight_assignment,
    normalized_edit_distance,
    ocr_reward,
    parse_boxes,
    parse_count,
    parse_number,
    parse_points,
    parse_polygon,
    parse_text,
    point_f1,
    point_in_box_f1,
    polygon_to_mask,
    soft_iou,
    soft_iou_or_point_f1,
    visual_reward,
)

# ----------------------------------------------------------------------------------------------------------
# Box IoU and soft IoU
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((0, 0, 2, 2), (1, 1, 3, 3), 1 / 7),  # inter 1x1 = 1, union 4 + 4 - 1 = 7
        ((0, 0, 2, 2), (0, 0, 2, 2), 1.0),
        ((0, 0, 4, 4), (1, 1, 3, 3), 4 / 16),  # contained: 4 / 16
        ((0, 0, 1, 1), (1, 0, 2, 1), 0.0),  # touching edges, no area in common
        ((0, 0, 1, 1), (5, 5, 6, 6), 0.0),
        ((2, 2, 0, 0), (0, 0, 2, 2), 1.0),  # corners given swapped are reordered
        ((0, 0, 2, 1), (1, 0, 3, 1), 1 / 3),  # inter 1, union 2 + 2 - 1 = 3
        ((0, 0, 0, 5), (0, 0, 0, 5), 0.0),  # zero area
        ((0.5, 0.5, 1.5, 1.5), (1.0, 1.0, 2.0, 2.0), 0.25 / 1.75),  # inter 0.5², union 1 + 1 - 0.25
    ],
)
def test_box_iou_hand_cases(a, b, expected):
    assert box_iou(a, b) == pytest.approx(expected)
    assert box_iou(b, a) == pytest.approx(expected)


@pytest.mark.parametrize(
    "bad", [(0, 0, 2), (0, 0, 2, 2, 2), (math.nan, 0, 2, 2), (0, 0, math.inf, 2), ("0", 0, 2, 2), None]
)
def test_box_iou_bad_boxes_score_zero(bad):
    assert box_iou(bad, (0, 0, 2, 2)) == 0.0


def test_soft_iou_empty_sets():
    assert soft_iou([], []) == 1.0
    assert soft_iou([], [(0, 0, 1, 1)]) == 0.0
    assert soft_iou([(0, 0, 1, 1)], []) == 0.0


def test_soft_iou_divides_by_the_larger_set():
    # One exact box against two gt boxes: (1 + 0) / max(1, 2) = 0.5; and the same with roles swapped.
    assert soft_iou([(0, 0, 2, 2)], [(0, 0, 2, 2), (5, 5, 6, 6)]) == pytest.approx(0.5)
    assert soft_iou([(0, 0, 2, 2), (5, 5, 6, 6)], [(0, 0, 2, 2)]) == pytest.approx(0.5)
    # Soft (no threshold): the 1/7 overlap earns 1/7.
    assert soft_iou([(1, 1, 3, 3)], [(0, 0, 2, 2)]) == pytest.approx(1 / 7)


def test_soft_iou_matching_is_optimal_where_greedy_is_not():
    # Boxes one pixel tall, so IoU is interval IoU on x.
    g1, g2 = (0, 0, 10, 1), (10, 0, 20, 1)
    p1, p2 = (4, 0, 15, 1), (0, 0, 3, 1)
    # IoU(p1, g1) = [4,10] / [0,15] = 6/15 = 0.4      IoU(p1, g2) = [10,15] / [4,20] = 5/16 = 0.3125
    # IoU(p2, g1) = [0,3] / [0,10] = 3/10 = 0.3       IoU(p2, g2) = 0
    # Greedy takes the best pair (p1, g1) = 0.4 and leaves p2-g2 = 0: (0.4 + 0) / 2 = 0.2.
    # Optimal: (p1, g2) + (p2, g1) = 0.3125 + 0.3 = 0.6125, / 2 = 0.30625.
    assert soft_iou([p1, p2], [g1, g2]) == pytest.approx(0.30625)
    assert soft_iou([p2, p1], [g2, g1]) == pytest.approx(0.30625)


def test_boxes_as_arrays_and_grounding_alias():
    gt = np.array([[0, 0, 2, 2]])
    assert soft_iou(torch.tensor([[1, 1, 3, 3]]), gt) == pytest.approx(1 / 7)
    assert visual_reward("grounding_box", "[[1, 1, 3, 3]]", gt) == pytest.approx(1 / 7)
    assert soft_iou_or_point_f1([(1, 1, 3, 3)], [(0, 0, 2, 2)]) == pytest.approx(1 / 7)  # boxes: soft IoU
    assert soft_iou_or_point_f1([(1, 1)], [(0, 0, 2, 2)]) == 1.0  # points: point F1 (inside the box)
    assert soft_iou_or_point_f1([], []) == 1.0


def _brute_force(weights: list[list[float]]) -> float:
    n, m = len(weights), len(weights[0])
    if n <= m:
        return max(
            sum(weights[i][c] for i, c in enumerate(cols)) for cols in itertools.permutations(range(m), n)
        )
    return max(sum(weights[r][j] for j, r in enumerate(rows)) for rows in itertools.permutations(range(n), m))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda n: st.integers(1, 5).flatmap(
            lambda m: st.lists(
                st.lists(st.floats(0, 1, allow_nan=False), min_size=m, max_size=m), min_size=n, max_size=n
            )
        )
    )
)
def test_assignment_matches_brute_force(weights):
    pairs = max_weight_assignment(weights)
    assert len({r for r, _ in pairs}) == len(pairs) == len({c for _, c in pairs})
    assert sum(weights[r][c] for r, c in pairs) == pytest.approx(_brute_force(weights), abs=1e-9)


# ----------------------------------------------------------------------------------------------------------
# Point F1
# ----------------------------------------------------------------------------------------------------------


def test_point_f1_radius_is_inclusive():
    # Distance from (0, 0) to (3, 4) is exactly 5.
    assert point_f1([(0, 0)], [(3, 4)], radius=5) == 1.0
    assert point_f1([(0, 0)], [(3, 4)], radius=4.9) == 0.0


def test_point_f1_precision_recall():
    # 3 predictions, 2 gts, 1 hit: P = 1/3, R = 1/2, F1 = 2 (1/6) / (5/6) = 2/5.
    assert point_f1([(0, 0), (50, 50), (60, 60)], [(1, 1), (100, 100)], radius=5) == pytest.approx(0.4)
    # Two predictions on one gt count once (one-to-one): P = 1/2, R = 1, F1 = 2 (1/2) / (3/2) = 2/3.
    assert point_f1([(0, 0), (1, 0)], [(0, 0)], radius=5) == pytest.approx(2 / 3)


def test_point_f1_matching_is_maximal_not_greedy():
    # gt A = (0, 0), B = (10, 0), radius 6. p1 = (4, 0) reaches A (4) and B (6); p2 = (-4, 0) reaches A only.
    # Greedy nearest-first gives p1 -> A and leaves p2 unmatched (TP 1, F1 = 0.5); the maximum matching
    # p1 -> B, p2 -> A has TP 2: P = R = 1, F1 = 1.
    assert point_f1([(4, 0), (-4, 0)], [(0, 0), (10, 0)], radius=6) == 1.0


def test_point_f1_against_boxes():
    boxes = [(0, 0, 2, 2), (10, 10, 20, 20)]
    assert point_in_box_f1([(2, 2), (15, 15)], boxes) == 1.0  # edges inclusive
    # One inside, one outside: P = R = 1/2, F1 = 1/2.
    assert point_f1([(1, 1), (5, 5)], boxes) == pytest.approx(0.5)
    assert point_f1([], []) == 1.0
    assert point_f1([], boxes) == 0.0
    assert point_f1([(1, 1)], []) == 0.0


# ----------------------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------------------


def test_mask_iou_hand_cases():
    a = np.array([[1, 1], [0, 0]], dtype=bool)
    b = np.array([[1, 0], [1, 0]], dtype=bool)
    assert mask_iou(a, b) == pytest.approx(1 / 3)  # inter 1, union 3
    assert mask_iou(torch.from_numpy(a), torch.from_numpy(b)) == pytest.approx(1 / 3)
    assert mask_iou(a, a) == 1.0
    assert mask_iou(np.zeros((2, 2), bool), np.zeros((2, 2), bool)) == 1.0
    assert mask_iou(np.zeros((2, 2), bool), a) == 0.0
    assert mask_iou(a, np.ones((2, 3), bool)) == 0.0  # shape mismatch
    assert mask_iou(None, a) == 0.0


def test_polygon_to_mask_includes_the_boundary_pixels():
    # Vertices on pixel centres 0 and 2: Pillow fills columns/rows 0, 1, 2 -> 9 pixels.
    mask = polygon_to_mask([(0, 0), (2, 0), (2, 2), (0, 2)], (5, 4))
    assert mask.shape == (4, 5) and mask.dtype == bool
    expected = np.zeros((4, 5), bool)
    expected[:3, :3] = True
    np.testing.assert_array_equal(mask, expected)


# ----------------------------------------------------------------------------------------------------------
# OCR and counting
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pred", "gt", "ned"),
    [
        ("kitten", "sitting", 3 / 7),  # k->s, e->i, +g
        ("flaw", "lawn", 2 / 4),  # -f, +n
        ("abc", "abd", 1 / 3),
        ("abc", "", 1.0),
        ("", "", 0.0),
        ("Hello", "hello", 1 / 5),  # case-sensitive
    ],
)
def test_normalized_edit_distance(pred, gt, ned):
    assert normalized_edit_distance(pred, gt) == pytest.approx(ned)
    assert ocr_reward(pred, gt) == pytest.approx(1 - ned)


def test_ocr_reward_non_string_is_zero():
    assert ocr_reward(None, "abc") == 0.0
    assert ocr_reward(123, "123") == 0.0


def test_count_rewards():
    assert absolute_count_error(3, 5) == 2 and isinstance(absolute_count_error(3, 5), int)
    assert count_reward(3, 5) == pytest.approx(0.6)  # 1 - 2/5
    assert count_reward(7, 5) == pytest.approx(0.6)
    assert count_reward(20, 5) == 0.0  # 1 - 15/5 < 0
    assert count_reward(0, 0) == 1.0
    assert count_reward(1, 0) == 0.0  # 1 - 1 / max(0, 1)
    assert count_reward(2, 1) == 0.0
    assert count_reward(math.nan, 3) == 0.0 and count_reward(None, 3) == 0.0


def test_chart_reward_relative_tolerance():
    assert chart_reward(10.2, 10) == 1.0  # 2 % exactly
    assert chart_reward(10.3, 10) == 0.0  # 3 %
    assert chart_reward(0, 0) == 1.0 and chart_reward(0.01, 0) == 0.0
    assert chart_reward("b", "B") == 1.0 and chart_reward("C", "B") == 0.0


# ----------------------------------------------------------------------------------------------------------
# Parsers
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[[1, 2, 3, 4], [5, 6, 7, 8]]", [(1, 2, 3, 4), (5, 6, 7, 8)]),
        ("The box is [1, 2, 3.5, 4].", [(1, 2, 3.5, 4)]),
        ("<box>1,2,3,4</box> and <box>(5, 6), (7, 8)</box>", [(1, 2, 3, 4), (5, 6, 7, 8)]),
        ('[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}]', [(1, 2, 3, 4)]),
        ("none here: []", []),
        ("see [note] then [[0, 0, 1, 1]]", [(0, 0, 1, 1)]),
        ("[1, 2, 3]", None),
        ("[[1, 2, 3, 4], [1, 2]]", None),
        ("<box>1,2,3</box>", None),
        ("<box>1,2,3,4</box><box>a,b,c,d</box>", None),
        ("[NaN, 1, 2, 3]", None),
        ("[1e999, 1, 2, 3]", None),
        ("[true, 1, 2, 3]", None),
        ("[[[1, 2, 3, 4]]]", None),
        ("no boxes at all", None),
        (None, None),
        (1234, None),
    ],
)
def test_parse_boxes(text, expected):
    assert parse_boxes(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[[1, 2], [3.5, 4]]", [(1, 2), (3.5, 4)]),
        ("[7, 8]", [(7, 8)]),
        ("<point>1, 2</point><point>3 4</point>", [(1, 2), (3, 4)]),
        ("[]", []),
        ("[[1, 2, 3]]", None),
        ("<point>1</point>", None),
        ("[Infinity, 2]", None),
        ("", None),
    ],
)
def test_parse_points(text, expected):
    assert parse_points(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3", 3),
        ("There are 3 circles and 2 squares. Answer: 5", 5),
        ("I count three.", 3),
        ("Seventeen", 17),
        ("answer is 12", 12),
        ("Answer: 1,000", 1000),
        ("7 apples", 7),
        ("3.5", None),
        ("-2", None),
        ("nothing", None),
        ("9" * 5000, None),
        (None, None),
    ],
)
def test_parse_count(text, expected):
    assert parse_count(text) == expected


def test_parse_number_polygon_and_text():
    assert parse_number("about 12.5%") == 12.5
    assert parse_number("Bar B is 3, so Answer: 4.25") == 4.25
    assert parse_polygon("[[0, 0], [4, 0], [0, 4]]") == [(0, 0), (4, 0), (0, 4)]
    assert parse_polygon("<polygon>0,0, 4,0, 0,4</polygon>") == [(0, 0), (4, 0), (0, 4)]
    assert parse_polygon("[0, 0, 4, 0, 0, 4]") == [(0, 0), (4, 0), (0, 4)]
    assert parse_polygon("[[0, 0], [4, 0]]") is None  # fewer than 3 vertices
    assert parse_polygon("[[0, 0], [1e12, 0], [0, 4]]") is None  # beyond the rasteriser's range
    assert parse_polygon("<polygon>0,0,4,0,0</polygon>") is None  # odd count
    assert parse_text("  hello world \n") == "hello world"
    # a reply that reasons first: its text is what follows the last "Answer:" (as parse_number reads it)
    assert parse_text("x = read()\nprint(x)\nAnswer: 12\nanswer:  kimi k2 ") == "kimi k2"
    assert visual_reward("ocr", "The sign reads\nANSWER: sitting", "sitting") == 1.0
    assert parse_text(None) is None and parse_text("x" * 10_000) is None


# ----------------------------------------------------------------------------------------------------------
# Dispatcher
# ----------------------------------------------------------------------------------------------------------

SQUARE_MASK = polygon_to_mask([(1, 1), (4, 1), (4, 4), (1, 4)], (8, 8))  # 4x4 = 16 pixels

TRUTHS = {
    "counting": 5,
    "grounding_box": [(0, 0, 2, 2)],
    "grounding_point": [(0, 0)],
    "segmentation": SQUARE_MASK,
    "ocr": "sitting",
    "chart": 10.0,
}


@pytest.mark.parametrize(
    ("kind", "output", "expected"),
    [
        ("counting", "I see 4. Answer: 4", 0.8),  # 1 - |4 - 5| / 5
        ("counting", "five", 1.0),
        ("grounding_box", "[[1, 1, 3, 3]]", 1 / 7),
        ("grounding_box", "<box>0,0,2,2</box>", 1.0),
        ("grounding_point", "[[3, 4]]", 1.0),  # distance 5 = default radius
        ("grounding_point", "[[3, 4.5]]", 0.0),
        ("segmentation", "[[1, 1], [4, 1], [4, 4], [1, 4]]", 1.0),
        ("segmentation", "[[1, 1], [2, 1], [2, 4], [1, 4]]", 8 / 16),  # columns 1-2 of the 4x4 square
        ("ocr", "  kitten ", 4 / 7),
        ("chart", "Answer: 10.1", 1.0),  # 1 % off
        ("chart", "10.3", 0.0),  # 3 % off
    ],
)
def test_visual_reward_hand_cases(kind, output, expected):
    assert visual_reward(kind, output, TRUTHS[kind]) == pytest.approx(expected)


def test_visual_reward_grounding_point_truth_variants_and_chart_labels():
    assert visual_reward("grounding_point", "[[1, 1]]", [(0, 0, 2, 2)]) == 1.0  # inside a gt box
    assert visual_reward("grounding_point", "[[0, 8]]", {"points": [(0, 0)], "radius": 8}) == 1.0
    assert visual_reward("grounding_point", "[[0, 8]]", [(0, 0)], point_radius=7) == 0.0
    assert visual_reward("chart", "Answer: b", "B") == 1.0
    assert visual_reward("chart", "C", "B") == 0.0
    with pytest.raises(ValueError, match="unknown visual task kind"):
        visual_reward("depth", "1", 1)


MALFORMED = [
    None,
    3,
    4.5,
    b"[[0, 0, 2, 2]]",
    ["[[0, 0, 2, 2]]"],
    "",
    "garbage",
    "nan",
    "[NaN, NaN, NaN, NaN]",
    "[[0, 0, 2]]",
    "<box>0,0,2,2,2</box>",
    "[[0, 0, 1]]",
    "x" * 200_000,
    "[" * 50_000,
    "<box>" * 20_000,
    "9" * 5_000,
    "[[0, 0, 2, 2]]" * 10_000,
]


@pytest.mark.parametrize("kind", [k for k in TASK_KINDS if k != "ocr"])
@pytest.mark.parametrize("output", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_output_scores_zero(kind, output):
    assert visual_reward(kind, output, TRUTHS[kind]) == 0.0


@pytest.mark.parametrize("output", [None, 3, b"sitting", ["sitting"], "sitting" * 1_000])
def test_malformed_ocr_output_scores_zero(output):
    assert visual_reward("ocr", output, "sitting") == 0.0


TOKENS = ["[", "]", ",", " ", "0", "1", "2.5", "-3", "1e999", "NaN", "Infinity", "<box>", "</box>", "<point>"]
TOKENS += ["</point>", "<polygon>", "</polygon>", "Answer:", "three", "{", "}", '"bbox_2d"', ":", "(", ")"]
structured_text = st.lists(st.sampled_from(TOKENS), max_size=40).map("".join)
anything = st.one_of(
    st.text(max_size=200),
    structured_text,
    st.none(),
    st.integers(),
    st.floats(),
    st.binary(max_size=20),
    st.lists(st.integers(), max_size=4),
)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(TASK_KINDS), output=anything)
def test_visual_reward_never_raises_and_stays_in_unit_interval(kind, output):
    reward = visual_reward(kind, output, TRUTHS[kind])
    assert isinstance(reward, float) and 0.0 <= reward <= 1.0
