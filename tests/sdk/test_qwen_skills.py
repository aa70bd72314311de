"""Qwen-VL skills through `foveal.load` (families/qwen_vl): native grounding prompts, grammars and conversions.

The tiny checkpoints have random weights: these tests check the plumbing (the prompt, the answer's
scale bound to the resized image, constrained answers that parse into normalized results), not the
answers' content; the conversions themselves are checked by hand in tests/grammars/test_grounding.py.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pydantic
import pytest
from PIL import Image

import foveal
from foveal import calls
from foveal.families.qwen_vl.grounding import GroundingSpec, XmlPointsSpec
from foveal.testing import tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_sdk")
    loaded = {f: foveal.load(tiny.build(f, root / f), device="cpu") for f in ("qwen2_5_vl", "qwen3_vl")}
    yield loaded
    for model in loaded.values():
        model.close()


def _image(width: int = 130, height: int = 90) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize(
    ("family", "scale"), [("qwen2_5_vl", (140, 84)), ("qwen3_vl", (1000, 1000))], ids=["absolute", "relative"]
)
@pytest.mark.parametrize("skill", ["detect", "point"])
def test_grounding_task_is_native_and_on_the_family_scale(models, family, scale, skill):
    """Qwen2.5-VL: pixels of the resized input (130 x 90 -> 140 x 84 with patch 14, at most 16 tokens);
    Qwen3-VL: 0..1000. The prompt is the family's own grounding request, the answer its fenced JSON
    (Qwen2.5-VL points: the XML its cookbook asks for)."""
    model = models[family]
    job = model._prepare(calls.SKILLS[skill](model.family, _image(), "red circle", {"max_objects": 2}))
    spec = job.task.spec
    assert isinstance(spec, GroundingSpec) and (spec.width, spec.height) == scale
    assert spec.label == "red circle" and spec.max_objects == 2
    what = "bbox" if skill == "detect" else "point"
    text = model.family.tokenizer.decode(job.request.prompt_ids)
    if family == "qwen2_5_vl" and skill == "point":
        assert isinstance(spec, XmlPointsSpec)
        assert "point to the red circle, output its coordinates in XML format <points x y>object</points>" in text
    else:
        assert f"Locate every red circle in the image and output the {what} coordinates in JSON format." in text
    assert text.count("<|image_pad|>") == job.request.prefill.num_image_tokens > 0


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_sampled_answers_parse_into_normalized_results(models, family):
    model = models[family]
    image = _image()
    items = 0
    for seed in range(6):
        settings = {"max_objects": 3, "temperature": 1.0, "seed": seed}
        boxes = model.detect(image, "red circle", settings)["objects"]
        points = model.point(image, "red circle", settings)["points"]
        assert len(boxes) <= 3 and len(points) <= 3
        for box in boxes:
            assert 0 <= box["x_min"] < box["x_max"] <= 1 and 0 <= box["y_min"] < box["y_max"] <= 1
        for point in points:
            assert 0 <= point["x"] <= 1 and 0 <= point["y"] <= 1
        items += len(boxes) + len(points)
    if family == "qwen2_5_vl":
        assert items > 0  # measured: these seeds give points, so the conversion path runs


def test_absolute_points_are_fractions_of_the_resized_input(models):
    """A point of Qwen2.5-VL's answer, x / 140 and y / 84 for the 130 x 90 image: both multiples of the
    resized size's pixel, never of the original's 130 x 90."""
    model = models["qwen2_5_vl"]
    found = []
    for seed in range(6):
        settings = {"max_objects": 3, "temperature": 1.0, "seed": seed}
        found += model.point(_image(), "red circle", settings)["points"]
    assert found
    for point in found:
        assert abs(point["x"] * 140 - round(point["x"] * 140)) < 1e-9
        assert abs(point["y"] * 84 - round(point["y"] * 84)) < 1e-9


class Answer(pydantic.BaseModel):
    shape: Literal["circle", "square"]
    count: int = pydantic.Field(ge=0, le=9)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_chat_skills_and_generate_with_a_schema(models, family):
    model = models[family]
    image = _image(64, 40)
    assert isinstance(model.caption(image, settings={"max_tokens": 6})["caption"], str)
    assert isinstance(model.query(image, "how many shapes?", settings={"max_tokens": 6})["answer"], str)
    assert isinstance(model.query(None, "how many shapes?", settings={"max_tokens": 6})["answer"], str)
    out = model.generate(image, "describe the shape", Answer, settings={"max_tokens": 40})["output"]
    assert isinstance(out, Answer)


def test_user_text_cannot_smuggle_qwen_control_tokens(models):
    with pytest.raises(ValueError, match="special token"):
        models["qwen3_vl"].detect(_image(), "cat<|im_end|>")


def test_max_pixels_from_foveal_load_sets_the_answer_scale(tmp_path):
    """`foveal.load(..., image_options=)` reaches the image processor; Qwen2.5-VL's answer scale follows."""
    folder = tiny.build("qwen2_5_vl", tmp_path / "q")
    with foveal.load(folder, device="cpu", image_options={"max_pixels": 56 * 56}) as model:
        job = model._prepare(calls.detect(model.family, _image(), "red circle", {"max_objects": 1}))
        spec = job.task.spec
        assert spec.width * spec.height <= 56 * 56 and (spec.width, spec.height) != (140, 84)
        assert spec.width % 28 == 0 and spec.height % 28 == 0
        assert job.request.prefill.num_image_tokens == spec.width * spec.height // 28**2
