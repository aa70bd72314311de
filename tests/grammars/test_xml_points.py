"""Qwen2.5-VL's XML points (families.qwen_vl.grounding.XmlPointsSpec): parsing, refusals, and answers sampled
under the grammar through foveal.load on a tiny random Qwen2.5-VL (the cookbook's prompt, the
resized image's scale, scored points, token budgets that hold)."""

from __future__ import annotations

import pytest

import foveal
from foveal import calls
from foveal.families.qwen_vl.grounding import XmlPointsSpec
from foveal.grammars import SchemaError, spatial
from foveal.testing import tiny
from foveal.vision import scenes


def test_an_answer_parses_into_normalized_points():
    spec = XmlPointsSpec("points", max_objects=4, label="cake", width=200, height=100)
    text = '```xml\n<points x1="50" y1="25" x2="200" y2="0" alt="cake">cake</points>\n```'
    assert spatial.parse(spec, text) == {"points": [{"x": 0.25, "y": 0.25}, {"x": 1.0, "y": 0.0}]}
    assert spatial.parse(spec, '```xml\n<points alt="cake">cake</points>\n```') == {"points": []}
    assert spatial.parse(spec, spec.example_answer(2))["points"] == [{"x": 1.0, "y": 1.0}] * 2


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"kind": "boxes"}, "answers points"),
        ({"label": 'the "big" cake'}, "XML answer cannot carry"),
        ({"label": "a<b"}, "XML answer cannot carry"),
    ],
)
def test_what_the_xml_answer_cannot_say_is_refused(fields, message):
    values = {"kind": "points", "max_objects": 2, "label": "cake", "width": 10, "height": 10, **fields}
    kind = values.pop("kind")
    with pytest.raises(SchemaError, match=message):
        XmlPointsSpec(kind, **values)


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    with foveal.load(tiny.build("qwen2_5_vl", tmp_path_factory.mktemp("xml") / "q"), device="cpu") as model:
        yield model


def test_point_asks_as_the_cookbook_and_answers_under_the_grammar(qwen25):
    image = scenes.render(scenes.generate_scene(1, 96))
    job = qwen25._prepare(calls.point(qwen25.family, image, "red circle", {"max_objects": 3}))
    assert isinstance(job.task.spec, XmlPointsSpec) and job.task.spec.width == job.task.spec.height == 84
    prompt = qwen25.family.tokenizer.decode(job.request.prompt_ids)
    assert (
        "point to the red circle, output its coordinates in XML format <points x y>object</points>" in prompt
    )
    bounds = spatial.item_token_bounds(
        job.task.spec, qwen25.family.tokenizer, vocab_size=qwen25.family.runner.vocab_size
    )
    found = 0
    for seed in range(12):
        result = qwen25.point(
            image, "red circle", settings={"max_objects": 3, "temperature": 1.0, "seed": seed}
        )
        points = result["points"]
        assert len(points) <= 3 and all(0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 for p in points)
        assert all(0.0 <= p["score"] <= 1.0 for p in points)
        # every spelling the model chose fits the worst case the token budget is sized from
        assert result.usage.completion_tokens + 1 <= bounds.answer(len(points))
        found += len(points)
    assert found


def test_qwen3_vl_points_stay_json(tmp_path):
    with foveal.load(tiny.build("qwen3_vl", tmp_path / "q3"), device="cpu") as model:
        task = calls.point(model.family, None, "red circle", {"max_objects": 2}).task
        assert not isinstance(task.spec, XmlPointsSpec)
