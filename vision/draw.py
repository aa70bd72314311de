"""Drawing results: a copy of the image with the boxes of `detect` and the points of `point` on it.

Results use Moondream's convention: coordinates normalized to [0, 1], origin at the top-left corner,
`{"objects": [{"x_min", "y_min", "x_max", "y_max"}]}` and `{"points": [{"x", "y"}]}`. A result is
validated whole before anything is drawn, so a bad result raises a ValueError naming the bad item
and the caller's image is never touched (drawing happens on the copy `load_image` returns). An item's
`"score"` (detect / point results carry one), where present, is written beside it to two decimals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

from PIL import Image, ImageDraw

from .images import load_image

BOX_KEYS = ("x_min", "y_min", "x_max", "y_max")
POINT_KEYS = ("x", "y")
# Saturated colours that stay distinct from each other and from most photo backgrounds.
PALETTE = ((255, 59, 48), (0, 199, 190), (255, 204, 0), (175, 82, 222), (52, 199, 89), (0, 122, 255))


def draw(image: Any, result: Mapping[str, Any]) -> Image.Image:
    """Return a new RGB image: `image` with the result's boxes and/or points drawn on it.

    `image` is anything `load_image` accepts; `result` is a dict with "objects" (boxes), "points",
    or both, in normalized coordinates. Raises ValueError for any other result.
    """
    boxes, points = parse_result(result)
    box_scores, point_scores = _scores(result, "objects"), _scores(result, "points")
    canvas = load_image(image)
    pen = ImageDraw.Draw(canvas)
    width, height = canvas.size
    line = max(2, round(min(width, height) / 150))
    for index, (x_min, y_min, x_max, y_max) in enumerate(boxes):
        corners = (_px(x_min, width), _px(y_min, height), _px(x_max, width), _px(y_max, height))
        colour = PALETTE[index % len(PALETTE)]
        pen.rectangle(corners, outline=colour, width=line)
        _label(pen, box_scores[index], corners[0] + line, corners[1] + line, colour)
    radius = max(3, round(min(width, height) / 80))
    for index, (x, y) in enumerate(points):
        cx, cy = _px(x, width), _px(y, height)
        bounds = (cx - radius, cy - radius, cx + radius, cy + radius)
        pen.ellipse(bounds, fill=PALETTE[0], outline=(255, 255, 255), width=max(1, radius // 3))
        _label(pen, point_scores[index], cx + radius + 1, cy - radius, PALETTE[0])
    return canvas


def _scores(result: Mapping[str, Any], key: str) -> list[float | None]:
    """Each item's score (None where it has none), checked to be a number in [0, 1]."""
    out: list[float | None] = []
    for i, item in enumerate(result.get(key, [])):
        score = item.get("score")
        # (typeshed's numbers.Real declares no comparisons; every Real compares with ints)
        if score is not None and not (isinstance(score, Real) and not isinstance(score, bool) and 0 <= score <= 1):  # type: ignore[operator]
            raise ValueError(f"{key}[{i}]['score'] = {score!r}; a score is a number in [0, 1]")
        out.append(None if score is None else float(score))
    return out


def _label(pen: ImageDraw.ImageDraw, score: float | None, x: int, y: int, colour: tuple[int, int, int]) -> None:
    if score is not None:
        pen.text((x, y), f"{score:.2f}", fill=colour, stroke_width=1, stroke_fill=(0, 0, 0))


def parse_result(result: Any) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
    """Validate a detect/point result; return its boxes and points as tuples of floats in [0, 1]."""
    if not isinstance(result, Mapping):
        raise ValueError(f"expected a result dict with 'objects' or 'points', got {type(result).__name__}")
    if "objects" not in result and "points" not in result:
        raise ValueError(
            f"a result to draw needs 'objects' (from detect) or 'points' (from point); got keys {sorted(result)}"
        )
    boxes = [_coords(item, BOX_KEYS, f"objects[{i}]") for i, item in enumerate(_items(result, "objects"))]
    for i, (x_min, y_min, x_max, y_max) in enumerate(boxes):
        if x_min > x_max or y_min > y_max:
            raise ValueError(f"objects[{i}] has x_min > x_max or y_min > y_max: {boxes[i]}")
    points = [_coords(item, POINT_KEYS, f"points[{i}]") for i, item in enumerate(_items(result, "points"))]
    return boxes, points


def _items(result: Mapping[str, Any], key: str) -> Sequence[Any]:
    items = result.get(key, [])
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ValueError(f"result[{key!r}] must be a list, got {type(items).__name__}")
    return items


def _coords(item: Any, keys: tuple[str, ...], where: str) -> tuple[float, ...]:
    if not isinstance(item, Mapping) or any(key not in item for key in keys):
        raise ValueError(f"{where} must be a dict with keys {', '.join(keys)}; got {item!r}")
    values = tuple(item[key] for key in keys)
    for key, value in zip(keys, values, strict=True):
        ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not 0.0 <= value <= 1.0:
            raise ValueError(f"{where}[{key!r}] = {value!r}; coordinates are numbers in [0, 1] (normalized)")
    return tuple(float(value) for value in values)


def _px(fraction: float, size: int) -> int:
    # Normalized 1.0 is the far edge; the last drawable pixel is size - 1.
    return min(size - 1, round(fraction * size))
