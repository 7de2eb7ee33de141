"""Visual RL rewards of Kimi K2.5 and the parsers that read a model's text answer.

The K2.5 report lists one reward per visual task family::

    grounding: soft_iou_or_point_f1, segmentation: mask_iou,
    ocr: normalized_edit_distance, counting: absolute_count_error

The definitions used here (all rewards lie in [0, 1]):

* Box IoU, boxes ``(x1, y1, x2, y2)`` in continuous pixel coordinates (corners are reordered if given
  swapped; a zero-area box scores 0)::

      IoU(A, B) = |A ∩ B| / |A ∪ B|

* Soft IoU over sets of boxes, with an optimal one-to-one matching M between predictions P and ground truth G
  (maximum total IoU, solved exactly by the Hungarian algorithm)::

      soft_iou(P, G) = Σ_{(p, g) ∈ M} IoU(p, g) / max(|P|, |G|)        (1 if both empty, 0 if one is)

* Point F1: a predicted point is a true positive when it is matched one-to-one (maximum bipartite matching)
  to a ground-truth point within ``radius`` pixels (Euclidean, inclusive), or to a ground-truth box that
  contains it (edges inclusive)::

      precision = TP / |P|,  recall = TP / |G|,  F1 = 2 · precision · recall / (precision + recall)

  (1 if both are empty, 0 if one is or TP = 0).

* Mask IoU on boolean masks of one shape: ``|M_p ∧ M_g| / |M_p ∨ M_g|`` (1 if both empty, 0 on a shape
  mismatch).

* OCR: ``NED(p, g) = Levenshtein(p, g) / max(len(p), len(g))`` (0 if both empty; unit-cost insertions,
  deletions and substitutions over Unicode code points, case-sensitive) and ``ocr_reward = 1 − NED``.

* Counting: ``absolute_count_error = |p − g|`` and ``count_reward = max(0, 1 − |p − g| / max(g, 1))``.

* Chart (numeric answer): ``1 if |p − g| ≤ 0.02 · |g| else 0`` (relative tolerance 2 %, so g = 0 needs
  p = 0 exactly); when the ground truth is a string (e.g. the label of the largest bar) the reward is exact
  match after stripping and case folding.

Every parser returns ``None`` on malformed input and :func:`visual_reward` turns that into a reward of 0.0:
it never raises because of the model output (None, non-str, garbage, NaN/inf numbers, wrong arity, more
than :data:`MAX_ITEMS` objects, text longer than :data:`MAX_OUTPUT_CHARS`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

Box = tuple[float, float, float, float]
Point = tuple[float, float]

MAX_OUTPUT_CHARS = 100_000  # longer model outputs are malformed (reward 0)
MAX_TEXT_CHARS = 4_096  # longest OCR answer that is scored; longer ones are malformed
MAX_ITEMS = 64  # most boxes / points / polygon vertices a parser accepts
MAX_NESTING = 3  # deepest JSON array nesting a parser looks at
MAX_POLYGON_COORD = 1e6  # polygon vertices beyond this are malformed (Pillow rasterises in 32-bit ints)
DEFAULT_POINT_RADIUS = 5.0  # pixels, for point F1 against ground-truth points
CHART_REL_TOL = 0.02  # relative tolerance of the chart reward
TASK_KINDS = ("counting", "grounding_box", "grounding_point", "segmentation", "ocr", "chart")

# ----------------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------------


def _is_real(value: Any) -> bool:
    """A finite real number that is not a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int too large for a float
        return False


def _as_tuple(item: Any, arity: int) -> tuple[float, ...] | None:
    """``item`` as a tuple of ``arity`` finite floats, or None (numpy arrays and torch tensors read too)."""
    if hasattr(item, "tolist") and not isinstance(item, list | tuple):
        item = item.tolist()
    if not isinstance(item, Sequence | np.ndarray) or isinstance(item, str) or len(item) != arity:
        return None
    if not all(_is_real(x) for x in item):
        return None
    return tuple(float(x) for x in item)


def _clip01(x: float) -> float:
    return 0.0 if not math.isfinite(x) else min(1.0, max(0.0, x))


# ----------------------------------------------------------------------------------------------------------
# Boxes and soft IoU
# ----------------------------------------------------------------------------------------------------------


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU(A, B) = |A ∩ B| / |A ∪ B| for boxes (x1, y1, x2, y2); corners reordered; zero area or bad → 0."""
    ta, tb = _as_tuple(a, 4), _as_tuple(b, 4)
    if ta is None or tb is None:
        return 0.0
    ax1, ax2 = sorted((ta[0], ta[2]))
    ay1, ay2 = sorted((ta[1], ta[3]))
    bx1, bx2 = sorted((tb[0], tb[2]))
    by1, by2 = sorted((tb[1], tb[3]))
    area_a = (ax2 - ax1) * (ay2 - ay1)
    area_b = (bx2 - bx1) * (by2 - by1)
    if area_a <= 0.0 or area_b <= 0.0:
        return 0.0
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = area_a + area_b - inter
    return _clip01(inter / union) if union > 0.0 else 0.0


def max_weight_assignment(weights: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """One-to-one pairs (row, col) maximising Σ weights[row][col] (weights finite and ≥ 0).

    Exact for every size: the Hungarian algorithm (Kuhn–Munkres with potentials, O(n² m)) on the cost
    −weight, run on the orientation with rows ≤ columns so that every row is assigned; with non-negative
    weights a complete row assignment of maximum sum is a maximum-weight matching.
    """
    n = len(weights)
    m = len(weights[0]) if n else 0
    if n == 0 or m == 0:
        return []
    transpose = n > m
    w = [list(col) for col in zip(*weights, strict=True)] if transpose else [list(row) for row in weights]
    n, m = len(w), len(w[0])
    inf = math.inf
    u, v = [0.0] * (n + 1), [0.0] * (m + 1)
    p, way = [0] * (m + 1), [0] * (m + 1)  # p[j]: row (1-based) assigned to column j
    for i in range(1, n + 1):
        p[0], j0 = i, 0
        minv, used = [inf] * (m + 1), [False] * (m + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = p[j0], inf, 0
            for j in range(1, m + 1):
                if not used[j]:
                    cur = -w[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(m + 1):
                if used[j]:
                    u[p[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if p[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            p[j0] = p[j1]
            j0 = j1
    pairs = [(p[j] - 1, j - 1) for j in range(1, m + 1) if p[j]]
    return sorted((c, r) for r, c in pairs) if transpose else sorted(pairs)


def soft_iou(pred_boxes: Sequence[Sequence[float]], gt_boxes: Sequence[Sequence[float]]) -> float:
    """soft_iou(P, G) = Σ_{(p,g) ∈ M} IoU(p, g) / max(|P|, |G|), M the max-total-IoU one-to-one matching.

    Both empty → 1.0; exactly one empty → 0.0. No IoU threshold: partial overlaps earn partial credit.
    """
    if len(pred_boxes) == 0 and len(gt_boxes) == 0:
        return 1.0
    if len(pred_boxes) == 0 or len(gt_boxes) == 0:
        return 0.0
    iou = [[box_iou(p, g) for g in gt_boxes] for p in pred_boxes]
    total = sum(iou[r][c] for r, c in max_weight_assignment(iou))
    return _clip01(total / max(len(pred_boxes), len(gt_boxes)))


# ----------------------------------------------------------------------------------------------------------
# Points and point F1
# ----------------------------------------------------------------------------------------------------------


def _point_hits(point: Sequence[float], gt: Sequence[float], radius: float) -> bool:
    """A gt of 4 numbers is a box (point inside, edges inclusive); of 2 a point (distance ≤ radius)."""
    pt = _as_tuple(point, 2)
    if pt is None:
        return False
    if (box := _as_tuple(gt, 4)) is not None:
        x1, x2 = sorted((box[0], box[2]))
        y1, y2 = sorted((box[1], box[3]))
        return x1 <= pt[0] <= x2 and y1 <= pt[1] <= y2
    if (g := _as_tuple(gt, 2)) is not None:
        return math.hypot(pt[0] - g[0], pt[1] - g[1]) <= radius
    return False


def max_bipartite_matching(adjacency: Sequence[Sequence[int]], n_right: int) -> int:
    """Size of a maximum matching of a bipartite graph (Kuhn's augmenting paths, exact, O(V·E))."""
    match_right = [-1] * n_right

    def augment(left: int, seen: list[bool]) -> bool:
        for right in adjacency[left]:
            if not seen[right]:
                seen[right] = True
                if match_right[right] < 0 or augment(match_right[right], seen):
                    match_right[right] = left
                    return True
        return False

    return sum(augment(left, [False] * n_right) for left in range(len(adjacency)))


def point_f1(
    pred_points: Sequence[Sequence[float]],
    gt_points: Sequence[Sequence[float]],
    radius: float = DEFAULT_POINT_RADIUS,
) -> float:
    """F1 = 2PR / (P + R), P = TP / |pred|, R = TP / |gt|, TP = size of a maximum one-to-one matching.

    A prediction may match a ground truth when it lies within ``radius`` pixels of a gt point (Euclidean,
    inclusive) or inside a gt box ``(x1, y1, x2, y2)`` (edges inclusive; gt items of 4 numbers are boxes).
    Both empty → 1.0; exactly one empty → 0.0.
    """
    if len(pred_points) == 0 and len(gt_points) == 0:
        return 1.0
    if len(pred_points) == 0 or len(gt_points) == 0:
        return 0.0
    adjacency = [[j for j, g in enumerate(gt_points) if _point_hits(p, g, radius)] for p in pred_points]
    tp = max_bipartite_matching(adjacency, len(gt_points))
    if tp == 0:
        return 0.0
    precision, recall = tp / len(pred_points), tp / len(gt_points)
    return _clip01(2 * precision * recall / (precision + recall))


def point_in_box_f1(pred_points: Sequence[Sequence[float]], gt_boxes: Sequence[Sequence[float]]) -> float:
    """Point F1 against ground-truth boxes: a point is a hit when inside a box (edges inclusive)."""
    return point_f1(pred_points, gt_boxes)


def soft_iou_or_point_f1(
    pred: Sequence[Sequence[float]], gt: Sequence[Sequence[float]], radius: float = DEFAULT_POINT_RADIUS
) -> float:
    """The K2.5 grounding reward: :func:`soft_iou` when the predictions are boxes (4 numbers each), else
    :func:`point_f1` (2 numbers each, against gt points within ``radius`` or gt boxes)."""
    if len(pred) and all(_as_tuple(p, 4) is not None for p in pred):
        return soft_iou(pred, gt)
    return point_f1(pred, gt, radius)


# ----------------------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------------------


def _as_bool_array(mask: Any) -> np.ndarray | None:
    if mask is None:
        return None
    if hasattr(mask, "detach"):  # a torch tensor
        mask = mask.detach().cpu().numpy()
    try:
        return np.asarray(mask).astype(bool)
    except (TypeError, ValueError):
        return None


def mask_iou(pred_mask: Any, gt_mask: Any) -> float:
    """|M_p ∧ M_g| / |M_p ∨ M_g| on boolean masks (numpy or torch; nonzero = True).

    Shape mismatch or an unreadable mask → 0.0; both empty → 1.0.
    """
    p, g = _as_bool_array(pred_mask), _as_bool_array(gt_mask)
    if p is None or g is None or p.shape != g.shape:
        return 0.0
    union = int(np.logical_or(p, g).sum())
    if union == 0:
        return 1.0
    return _clip01(int(np.logical_and(p, g).sum()) / union)


def polygon_to_mask(points: Sequence[Sequence[float]], size: tuple[int, int]) -> np.ndarray:
    """Boolean mask of shape (height, width) for ``size = (width, height)``: Pillow's filled polygon.

    Rasterised with ``ImageDraw.polygon(points, fill=...)``, the same call the synthetic tasks draw with,
    so a polygon reproduces the drawn pixels exactly.
    """
    width, height = size
    canvas = Image.new("L", (int(width), int(height)), 0)
    ImageDraw.Draw(canvas).polygon([(float(x), float(y)) for x, y in points], fill=255)
    return np.asarray(canvas) > 0


# ----------------------------------------------------------------------------------------------------------
# OCR and counting
# ----------------------------------------------------------------------------------------------------------


def levenshtein(a: str, b: str) -> int:
    """Unit-cost edit distance (insert, delete, substitute) over code points; O(len(a)·len(b))."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def normalized_edit_distance(pred: str, gt: str) -> float:
    """NED = Levenshtein(pred, gt) / max(len(pred), len(gt)); 0.0 if both are empty."""
    longest = max(len(pred), len(gt))
    return 0.0 if longest == 0 else levenshtein(pred, gt) / longest


def ocr_reward(pred: Any, gt: str) -> float:
    """1 − NED(pred, gt); a non-str prediction → 0.0."""
    if not isinstance(pred, str):
        return 0.0
    return _clip01(1.0 - normalized_edit_distance(pred, gt))


def absolute_count_error(pred: int | float, gt: int | float) -> int | float:
    """|pred − gt| (an int when both are ints)."""
    return abs(pred - gt)


def count_reward(pred: Any, gt: int | float) -> float:
    """max(0, 1 − |pred − gt| / max(gt, 1)); a non-finite or non-numeric prediction → 0.0."""
    if not _is_real(pred) or not _is_real(gt):
        return 0.0
    return _clip01(1.0 - float(absolute_count_error(pred, gt)) / max(float(gt), 1.0))


def chart_reward(pred: Any, gt: float | int | str, rel_tol: float = CHART_REL_TOL) -> float:
    """Numeric gt: 1.0 if |pred − gt| ≤ rel_tol · |gt| else 0.0. String gt: exact match (strip, casefold)."""
    if isinstance(gt, str):
        return float(isinstance(pred, str) and pred.strip().casefold() == gt.strip().casefold())
    if not _is_real(pred) or not _is_real(gt):
        return 0.0
    return float(abs(float(pred) - float(gt)) <= rel_tol * abs(float(gt)))


# ----------------------------------------------------------------------------------------------------------
# Parsers of model text
# ----------------------------------------------------------------------------------------------------------

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
_WORD_VALUES = {word: value for value, word in enumerate(_WORDS)}
_COUNT_TOKEN = r"(?:[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\d+(?:\.\d+)?|" + "|".join(_WORDS) + r")"
_COUNT_TOKEN_RE = re.compile(r"(?<![\w.])" + _COUNT_TOKEN + r"(?![\w])", re.IGNORECASE)
_ANSWER_RE = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*(" + _COUNT_TOKEN + r")(?![\w])", re.IGNORECASE)
_MAX_DIGITS = 18
_ANSWER_LINE_RE = re.compile(r"\banswer\s*:", re.IGNORECASE)


def _usable_text(text: Any) -> str | None:
    return text if isinstance(text, str) and len(text) <= MAX_OUTPUT_CHARS else None


def _token_value(token: str) -> float | None:
    """Value of a number token (digits with optional thousands commas and decimals) or a number word."""
    token = token.strip().lower()
    if token in _WORD_VALUES:
        return float(_WORD_VALUES[token])
    digits = token.replace(",", "")
    if sum(c.isdigit() for c in digits) > _MAX_DIGITS:
        return None
    try:
        value = float(digits)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_number(text: Any) -> float | None:
    """The number after the last ``Answer: x`` (or ``answer is x``), else the first number in the text."""
    text = _usable_text(text)
    if text is None:
        return None
    answers = _ANSWER_RE.findall(text)
    if answers:
        return _token_value(answers[-1])
    match = _COUNT_TOKEN_RE.search(text)
    return None if match is None else _token_value(match.group(0))


def parse_count(text: Any) -> int | None:
    """A non-negative integer count: a final ``Answer: N`` wins, else the first integer (or number word
    zero…twenty). A non-integral (``3.5``) or negative number is malformed → None."""
    value = parse_number(text)
    if value is None or value < 0 or not value.is_integer():
        return None
    return int(value)


def parse_text(text: Any) -> str | None:
    """The text after the last ``Answer:`` (case-insensitive; a reply that reasons first ends with its answer,
    as ``parse_number`` reads it), else the whole text; stripped. None if not a str or longer than
    :data:`MAX_TEXT_CHARS` after stripping."""
    if not isinstance(text, str):
        return None
    answers = _ANSWER_LINE_RE.split(text)
    text = answers[-1].strip()
    return text if len(text) <= MAX_TEXT_CHARS else None


def _top_level_arrays(text: str) -> list[str]:
    """Substrings of ``text`` that are balanced top-level ``[...]`` groups nested at most MAX_NESTING deep."""
    groups, depth, deepest, start = [], 0, 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth == 0:
                start, deepest = i, 0
            depth += 1
            deepest = max(deepest, depth)
        elif ch == "]" and depth > 0:
            depth -= 1
            if depth == 0 and deepest <= MAX_NESTING:
                groups.append(text[start : i + 1])
    return groups


def _parse_json_items(text: str, arity: int, keys: tuple[str, ...]) -> list[tuple[float, ...]] | None:
    """The first top-level JSON array that reads as a list of ``arity``-tuples (or a single tuple).

    Items may also be objects carrying the tuple under one of ``keys`` (``{"bbox_2d": [...]}``).
    """
    for group in _top_level_arrays(text):
        try:
            value = json.loads(group)
        except (ValueError, RecursionError):
            continue
        items = _items_from_json(value, arity, keys)
        if items is not None:
            return items
    return None


def _items_from_json(value: Any, arity: int, keys: tuple[str, ...]) -> list[tuple[float, ...]] | None:
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        return None
    if value and not isinstance(value[0], list | dict):  # a single flat tuple
        single = _as_tuple(value, arity)
        return None if single is None else [single]
    items = []
    for item in value:
        if isinstance(item, dict):
            item = next((item[k] for k in keys if k in item), None)
        parsed = _as_tuple(item, arity)
        if parsed is None:
            return None
        items.append(parsed)
    return items


def _parse_tags(text: str, tag: str, arity: int | None) -> list[tuple[float, ...]] | None:
    """Numbers inside every ``<tag>...</tag>``; None if any tag does not hold exactly ``arity`` numbers."""
    bodies = re.findall(rf"<{tag}>([^<]*)</{tag}>", text, flags=re.IGNORECASE | re.DOTALL)
    if not bodies or len(bodies) > MAX_ITEMS:
        return None
    items = []
    for body in bodies:
        tokens = _NUMBER_RE.findall(body)
        if (arity is not None and len(tokens) != arity) or len(tokens) > 2 * MAX_ITEMS:
            return None
        if _NUMBER_RE.sub("", body).strip(" \t\n,;()[]") != "":
            return None
        values = [_token_value(t) for t in tokens]
        if any(v is None for v in values):
            return None
        items.append(tuple(float(v) for v in values))  # type: ignore[arg-type]
    return items


def parse_boxes(text: Any) -> list[Box] | None:
    """Boxes from ``<box>x1,y1,x2,y2</box>`` tags (all of them), else from the first JSON array shaped as
    ``[[x1,y1,x2,y2], ...]``, a single ``[x1,y1,x2,y2]``, or objects with ``bbox_2d``/``bbox``/``box``.
    ``[]`` is a valid empty answer. Wrong arity, NaN/inf, more than MAX_ITEMS boxes → None."""
    text = _usable_text(text)
    if text is None:
        return None
    if re.search(r"<box>", text, re.IGNORECASE):
        return _parse_tags(text, "box", 4)  # type: ignore[return-value]
    return _parse_json_items(text, 4, ("bbox_2d", "bbox", "box"))  # type: ignore[return-value]


def parse_points(text: Any) -> list[Point] | None:
    """Points from ``<point>x,y</point>`` tags, else the first JSON array ``[[x,y], ...]`` or ``[x,y]``
    (objects with ``point_2d``/``point`` also read). ``[]`` is a valid empty answer."""
    text = _usable_text(text)
    if text is None:
        return None
    if re.search(r"<point>", text, re.IGNORECASE):
        return _parse_tags(text, "point", 2)  # type: ignore[return-value]
    return _parse_json_items(text, 2, ("point_2d", "point"))  # type: ignore[return-value]


def parse_polygon(text: Any) -> list[Point] | None:
    """Polygon vertices (at least 3) from ``<polygon>x1,y1,x2,y2,...</polygon>`` or a JSON array
    ``[[x,y], ...]`` (also a flat ``[x1,y1,x2,y2,...]`` of even length ≥ 6). None on malformed input,
    including a coordinate beyond ±MAX_POLYGON_COORD."""
    text = _usable_text(text)
    if text is None:
        return None
    if re.search(r"<polygon>", text, re.IGNORECASE):
        tagged = _parse_tags(text, "polygon", None)
        if tagged is None or len(tagged) != 1 or len(tagged[0]) % 2:
            return None
        flat: Sequence[float] = tagged[0]
        points = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    else:
        points = _parse_json_items(text, 2, ("points", "polygon"))  # type: ignore[assignment]
        if points is None:
            points = _flat_polygon(text)
    if points is None or not 3 <= len(points) <= MAX_ITEMS:
        return None
    if any(abs(c) > MAX_POLYGON_COORD for point in points for c in point):
        return None
    return [(float(x), float(y)) for x, y in points]


def _flat_polygon(text: str) -> list[Point] | None:
    for group in _top_level_arrays(text):
        try:
            value = json.loads(group)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, list) and len(value) % 2 == 0 and len(value) >= 6:
            flat = _as_tuple(value, len(value))
            if flat is not None:
                return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    return None


# ----------------------------------------------------------------------------------------------------------
# Dispatcher
# ----------------------------------------------------------------------------------------------------------


def _grounding_point_reward(points: list[Point] | None, truth: Any, radius: float) -> float:
    if points is None:
        return 0.0
    if isinstance(truth, dict):
        radius = float(truth.get("radius", radius))
        truth = truth.get("points", truth.get("boxes", []))
    return point_f1(points, truth, radius)


def _segmentation_reward(text: str, truth: Any) -> float:
    points = parse_polygon(text)
    gt = _as_bool_array(truth)
    if points is None or gt is None or gt.ndim != 2:
        return 0.0
    height, width = gt.shape
    return mask_iou(polygon_to_mask(points, (width, height)), gt)


def visual_reward(
    task_kind: str,
    model_output: Any,
    ground_truth: Any,
    *,
    point_radius: float = DEFAULT_POINT_RADIUS,
    chart_rel_tol: float = CHART_REL_TOL,
) -> float:
    """The reward in [0, 1] of ``model_output`` for one visual task.

    ====================  ===================================  ============================================
    kind                  ground truth                         reward
    ====================  ===================================  ============================================
    ``counting``          int                                  count_reward(parse_count(out), gt)
    ``grounding_box``     list of boxes                        soft_iou(parse_boxes(out), gt)
    ``grounding_point``   list of points (or boxes, or a dict  point_f1(parse_points(out), gt, radius)
                          ``{"points"|"boxes": ..., "radius"}``)
    ``segmentation``      bool mask (H, W)                     mask_iou(polygon_to_mask(parse_polygon(out)))
    ``ocr``               str                                  1 − NED(parse_text(out), gt)
    ``chart``             float (or str label)                 chart_reward(parse_number(out), gt)
    ====================  ===================================  ============================================

    A reply that reasons first scores by its final ``Answer: ...`` (counts, chart numbers and OCR text read
    what follows the last one; boxes, points and polygons in tags win over other arrays).

    Malformed output (unparseable, None, non-str, NaN/inf, wrong arity, too long) → 0.0. An unknown
    ``task_kind`` is a caller error and raises ValueError.
    """
    if task_kind not in TASK_KINDS:
        raise ValueError(f"unknown visual task kind {task_kind!r}; expected one of {TASK_KINDS}")
    if _usable_text(model_output) is None:
        return 0.0
    if task_kind == "counting":
        count = parse_count(model_output)
        reward = 0.0 if count is None else count_reward(count, ground_truth)
    elif task_kind == "grounding_box":
        boxes = parse_boxes(model_output)
        reward = 0.0 if boxes is None else soft_iou(boxes, ground_truth)
    elif task_kind == "grounding_point":
        reward = _grounding_point_reward(parse_points(model_output), ground_truth, point_radius)
    elif task_kind == "segmentation":
        reward = _segmentation_reward(model_output, ground_truth)
    elif task_kind == "ocr":
        text = parse_text(model_output)
        reward = 0.0 if text is None else ocr_reward(text, str(ground_truth))
    else:
        reward = _chart_output_reward(model_output, ground_truth, chart_rel_tol)
    return _clip01(float(reward))


def _chart_output_reward(text: str, truth: Any, rel_tol: float) -> float:
    if isinstance(truth, str):
        answers = re.findall(r"answer\s*(?:is)?\s*[:=]\s*(.+)", text, flags=re.IGNORECASE)
        label = answers[-1] if answers else text
        return chart_reward(label.strip().rstrip("."), truth)
    value = parse_number(text)
    return 0.0 if value is None else chart_reward(value, truth, rel_tol)


__all__ = [
    "CHART_REL_TOL",
    "DEFAULT_POINT_RADIUS",
    "TASK_KINDS",
    "absolute_count_error",
    "box_iou",
    "chart_reward",
    "count_reward",
    "levenshtein",
    "mask_iou",
    "max_bipartite_matching",
    "max_weight_assignment",
    "normalized_edit_distance",
    "ocr_reward",
    "parse_boxes",
    "parse_count",
    "parse_number",
    "parse_points",
    "parse_polygon",
    "parse_text",
    "point_f1",
    "point_in_box_f1",
    "polygon_to_mask",
    "soft_iou",
    "soft_iou_or_point_f1",
    "visual_reward",
]
