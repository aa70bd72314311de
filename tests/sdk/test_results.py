"""Result types: plain dicts for code, drawn images for Jupyter."""

from __future__ import annotations

import copy
import io
import json
import pickle

import numpy as np
import pytest
from IPython.core.formatters import DisplayFormatter
from PIL import Image

from foveal.results import (
    DISPLAY_MAX_SIDE,
    CaptionResult,
    DetectResult,
    GenerateResult,
    PointResult,
    QueryResult,
    Result,
)
from foveal.vision.draw import PALETTE

BOX = {"x_min": 0.25, "y_min": 0.2, "x_max": 0.75, "y_max": 0.8}
WHITE = (255, 255, 255)


@pytest.fixture
def image() -> Image.Image:
    return Image.new("RGB", (200, 100), WHITE)


def decode_png(data: bytes) -> Image.Image:
    assert data.startswith(b"\x89PNG")
    return Image.open(io.BytesIO(data)).convert("RGB")


def all_results(image):
    return [
        (CaptionResult("a red square", image=image), {"caption": "a red square"}),
        (QueryResult("two", image=image), {"answer": "two"}),
        (DetectResult([BOX], image=image), {"objects": [BOX]}),
        (PointResult([{"x": 0.5, "y": 0.5}], image=image), {"points": [{"x": 0.5, "y": 0.5}]}),
        (GenerateResult('{"n": 2}', {"n": 2}, image=image), {"text": '{"n": 2}', "output": {"n": 2}}),
    ]


def test_results_are_plain_dicts_to_code(image):
    for result, plain in all_results(image):
        assert isinstance(result, dict)
        assert result == plain and plain == result
        assert json.dumps(result) == json.dumps(plain)
        assert repr(result) == repr(plain)
        assert list(result) == list(plain), "the image is an attribute, never a key"
        assert dict(result) == plain and type(dict(result)) is dict


def test_image_is_kept_by_reference_and_ignored_by_equality(image):
    result = DetectResult([BOX], image=image)
    assert result.image is image
    assert result == DetectResult([BOX], image=None)
    assert not hasattr(result, "__dict__"), "slots only: no stray attributes"


def test_pickle_and_copy_keep_data_and_image(image):
    result = PointResult([{"x": 0.1, "y": 0.9}], image=image)
    for clone in (pickle.loads(pickle.dumps(result)), copy.copy(result), copy.deepcopy(result)):
        assert type(clone) is PointResult and clone == result
        assert np.array_equal(np.asarray(clone.image), np.asarray(image))


def test_generic_result_takes_any_mapping(image):
    result = Result({"objects": [BOX]}, image=image, extra=1)
    assert result == {"objects": [BOX], "extra": 1} and result.image is image


def test_detect_and_point_results_check_coordinates():
    with pytest.raises(ValueError, match=r"objects\[0\]\['x_max'\] = 2"):
        DetectResult([{"x_min": 0.1, "y_min": 0.1, "x_max": 2, "y_max": 0.5}])
    with pytest.raises(ValueError, match=r"points\[0\] must be a dict with keys x, y"):
        PointResult([{"x": 0.5}])
    with pytest.raises(ValueError, match=r"result\['objects'\] must be a list"):
        DetectResult(BOX)


def test_png_shows_the_boxes_drawn(image):
    drawn = decode_png(DetectResult([BOX], image=image)._repr_png_())
    assert drawn.size == (200, 100)
    assert drawn.getpixel((50, 50)) == PALETTE[0] and drawn.getpixel((100, 50)) == WHITE


def test_png_shows_the_points_drawn(image):
    drawn = decode_png(PointResult([{"x": 0.5, "y": 0.5}], image=image)._repr_png_())
    assert drawn.getpixel((100, 50)) == PALETTE[0] and drawn.getpixel((10, 10)) == WHITE


def test_png_of_a_text_result_is_the_image(image):
    drawn = decode_png(CaptionResult("blank", image=image)._repr_png_())
    assert np.array_equal(np.asarray(drawn), np.asarray(image))


def test_large_images_are_previewed_downscaled():
    big = Image.new("RGB", (3000, 1500), WHITE)
    drawn = decode_png(PointResult([{"x": 0.5, "y": 0.5}], image=big)._repr_png_())
    assert max(drawn.size) == DISPLAY_MAX_SIDE and drawn.size == (768, 384)
    assert drawn.getpixel((384, 192)) == PALETTE[0]


def test_any_image_input_renders(image):
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    for source in (np.asarray(image), buffer.getvalue()):
        drawn = decode_png(DetectResult([BOX], image=source)._repr_png_())
        assert drawn.getpixel((50, 50)) == PALETTE[0]


def test_without_image_jupyter_falls_back_to_text():
    result = DetectResult([BOX])
    assert result._repr_png_() is None and result._repr_html_() is None
    with pytest.raises(ValueError, match="no image to draw on"):
        result.annotated()


def test_html_shows_image_and_escaped_data(image):
    page = CaptionResult("<b>bold</b> & more", image=image)._repr_html_()
    assert '<img src="data:image/png;base64,' in page
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; more" in page and "<b>" not in page


def test_html_survives_values_json_cannot_encode(image):
    class Answer:
        def __repr__(self) -> str:
            return "Answer(n=2)"

    assert "Answer(n=2)" in GenerateResult("n=2", Answer(), image=image)._repr_html_()
    assert "generator" in CaptionResult((chunk for chunk in ["a", "b"]), image=image)._repr_html_()


def test_ipython_display_uses_the_drawn_image(image):
    data, _ = DisplayFormatter().format(DetectResult([BOX], image=image))
    assert {"image/png", "text/html", "text/plain"} <= set(data)
    assert data["text/plain"] == repr({"objects": [BOX]})
    assert decode_png(data["image/png"]).getpixel((50, 50)) == PALETTE[0]
    data, _ = DisplayFormatter().format(DetectResult([BOX]))
    assert set(data) == {"text/plain"}
