"""foveal.vision.draw: boxes and points land where normalized coordinates say; bad results are refused."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

import foveal.vision
from foveal.vision import draw
from foveal.vision.draw import PALETTE

WHITE = (255, 255, 255)


@pytest.fixture
def blank() -> Image.Image:
    return Image.new("RGB", (200, 100), WHITE)


def at(image: Image.Image, x: int, y: int) -> tuple[int, ...]:
    return image.getpixel((x, y))


def test_draw_is_exported_from_foveal_vision():
    assert foveal.vision.draw is draw and callable(draw)


def test_box_outline_lands_on_normalized_coordinates(blank):
    out = draw(blank, {"objects": [{"x_min": 0.25, "y_min": 0.2, "x_max": 0.75, "y_max": 0.8}]})
    # 200x100 image: the box spans x 50..150, y 20..80.
    for x, y in [(50, 50), (150, 50), (100, 20), (100, 80)]:
        assert at(out, x, y) == PALETTE[0], (x, y)
    for x, y in [(100, 50), (40, 50), (160, 50), (100, 10), (100, 90)]:
        assert at(out, x, y) == WHITE, (x, y)


def test_each_box_gets_its_own_colour(blank):
    boxes = [
        {"x_min": 0.0, "y_min": 0.0, "x_max": 0.3, "y_max": 0.3},
        {"x_min": 0.6, "y_min": 0.6, "x_max": 0.9, "y_max": 0.9},
    ]
    out = draw(blank, {"objects": boxes})
    # First box: x 0..60, y 0..30; second: x 120..180, y 60..90.
    assert at(out, 60, 15) == PALETTE[0] and at(out, 30, 30) == PALETTE[0]
    assert at(out, 120, 75) == PALETTE[1] and at(out, 150, 90) == PALETTE[1]
    assert PALETTE[0] != PALETTE[1]


def test_points_land_on_normalized_coordinates(blank):
    out = draw(blank, {"points": [{"x": 0.5, "y": 0.5}, {"x": 0.1, "y": 0.9}]})
    assert at(out, 100, 50) == PALETTE[0]
    assert at(out, 20, 90) == PALETTE[0]
    assert at(out, 180, 10) == WHITE and at(out, 100, 10) == WHITE


def test_points_on_the_edges_are_drawn(blank):
    out = draw(blank, {"points": [{"x": 0, "y": 0}, {"x": 1, "y": 1}]})
    assert at(out, 0, 0) == PALETTE[0]
    assert at(out, 199, 99) == PALETTE[0]


def test_boxes_and_points_together(blank):
    result = {
        "objects": [{"x_min": 0.1, "y_min": 0.1, "x_max": 0.4, "y_max": 0.9}],
        "points": [{"x": 0.8, "y": 0.5}],
        "caption": "ignored extra key",
    }
    out = draw(blank, result)
    assert at(out, 20, 50) == PALETTE[0]  # left edge of the box
    assert at(out, 160, 50) == PALETTE[0]  # the point


def test_draws_on_a_copy(blank):
    before = np.asarray(blank).copy()
    out = draw(blank, {"points": [{"x": 0.5, "y": 0.5}]})
    assert out is not blank and out.mode == "RGB" and out.size == blank.size
    assert np.array_equal(np.asarray(blank), before)


def test_empty_lists_draw_nothing(blank):
    assert np.array_equal(np.asarray(draw(blank, {"objects": [], "points": []})), np.asarray(blank))


def test_any_image_input_is_accepted(blank):
    buffer = io.BytesIO()
    blank.save(buffer, "PNG")
    result = {"points": [{"x": 0.5, "y": 0.5}]}
    for source in (np.asarray(blank), buffer.getvalue(), blank.convert("L")):
        assert at(draw(source, result), 100, 50) == PALETTE[0]


def test_numpy_coordinates_are_accepted(blank):
    out = draw(blank, {"points": [{"x": np.float32(0.5), "y": np.float64(0.5)}]})
    assert at(out, 100, 50) == PALETTE[0]


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (None, "expected a result dict"),
        ([{"x": 0.5, "y": 0.5}], "expected a result dict"),
        ("objects", "expected a result dict"),
        ({}, "needs 'objects' .* or 'points'"),
        ({"caption": "a cat"}, r"needs 'objects' .*got keys \['caption'\]"),
        ({"objects": {"x_min": 0}}, r"result\['objects'\] must be a list"),
        ({"points": "0.5,0.5"}, r"result\['points'\] must be a list"),
        (
            {"objects": [[0.1, 0.1, 0.2, 0.2]]},
            r"objects\[0\] must be a dict with keys x_min, y_min, x_max, y_max",
        ),
        ({"objects": [{"x_min": 0.1, "y_min": 0.1, "x_max": 0.2}]}, r"objects\[0\] must be a dict"),
        ({"points": [{"x": 0.5, "y": 0.5}, {"x": 0.5}]}, r"points\[1\] must be a dict with keys x, y"),
        (
            {"points": [{"x": 1.5, "y": 0.5}]},
            r"points\[0\]\['x'\] = 1.5; coordinates are numbers in \[0, 1\]",
        ),
        ({"points": [{"x": 0.5, "y": -0.01}]}, r"points\[0\]\['y'\] = -0.01"),
        ({"points": [{"x": math.nan, "y": 0.5}]}, r"\['x'\] = nan"),
        ({"points": [{"x": math.inf, "y": 0.5}]}, r"\['x'\] = inf"),
        ({"points": [{"x": True, "y": 0.5}]}, r"\['x'\] = True"),
        ({"points": [{"x": "0.5", "y": 0.5}]}, r"\['x'\] = '0.5'"),
        ({"points": [{"x": 50, "y": 20}]}, r"normalized"),
        (
            {"objects": [{"x_min": 0.6, "y_min": 0.1, "x_max": 0.2, "y_max": 0.2}]},
            r"objects\[0\] has x_min > x_max",
        ),
        ({"objects": [{"x_min": 0.1, "y_min": 0.5, "x_max": 0.2, "y_max": 0.2}]}, r"y_min > y_max"),
    ],
)
def test_bad_results_are_refused(blank, result, message):
    with pytest.raises(ValueError, match=message):
        draw(blank, result)


def test_bad_image_is_refused_with_image_error():
    with pytest.raises(foveal.vision.ImageError):
        draw(b"not an image", {"points": []})


def test_a_score_is_written_inside_its_box_and_beside_its_point(blank):
    box = {"x_min": 0.25, "y_min": 0.2, "x_max": 0.75, "y_max": 0.8}
    plain, scored = draw(blank, {"objects": [box]}), draw(blank, {"objects": [{**box, "score": 0.87}]})
    diff = np.argwhere(np.any(np.asarray(plain) != np.asarray(scored), axis=-1))
    assert len(diff) and diff[:, 1].min() >= 50 and diff[:, 0].min() >= 20  # rows, cols inside the box
    assert diff[:, 1].max() < 150 and diff[:, 0].max() < 80
    point = {"x": 0.5, "y": 0.5}
    assert draw(blank, {"points": [point]}).tobytes() != draw(blank, {"points": [{**point, "score": 0.5}]}).tobytes()
    with pytest.raises(ValueError, match=r"objects\[0\]\['score'\] = 1.5"):
        draw(blank, {"objects": [{**box, "score": 1.5}]})
