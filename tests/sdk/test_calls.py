"""One call path for every skill: the table of skills, twins that cannot drift, and `Family.prepare`'s
promises (families/prepared.py INVARIANTS), on the tiny shapes model."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest

import foveal
from foveal import calls
from foveal.families.prepared import CallLimits, Prepared
from foveal.grammars import SchemaError
from foveal.model import Model

SDK = Path(foveal.__file__).resolve().parent


def _parameters(function) -> list[inspect.Parameter]:
    return list(inspect.signature(function).parameters.values())


@pytest.mark.parametrize("skill", sorted(calls.SKILLS))
def test_each_skill_and_its_async_twin_take_the_builders_arguments(skill):
    builder = calls.SKILLS[skill]
    sync, asynchronous = getattr(Model, skill), getattr(Model, f"a{skill}")
    assert inspect.iscoroutinefunction(asynchronous) and not inspect.iscoroutinefunction(sync)
    expected = _parameters(builder)[1:]  # less the family
    for method in (sync, asynchronous):
        assert _parameters(method)[1:] == expected, f"{method.__name__} drifted from calls.{builder.__name__}"


def test_the_facade_knows_no_spec_type_no_scorer_and_no_tokenizer_internals():
    tree = ast.parse((SDK / "model.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert not imported & {"spatial", "SpatialSpec", "Decoded", "with_scores", "SCORE_ALTERNATIVES"}
    getattr_calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr"]
    assert not getattr_calls, "model.py reads attributes by name"
    isinstances = [
        ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "isinstance"
    ]
    assert not [text for text in isinstances if "spec" in text], isinstances


def test_query_and_aquery_answer_alike_by_position(shapes_model, image):
    sync = shapes_model.query(image, "how many shapes?", False, None, False, {"max_tokens": 8})
    asynchronous = asyncio.run(shapes_model.aquery(image, "how many shapes?", False, None, False, {"max_tokens": 8}))
    assert sync["answer"] == asynchronous["answer"]


def test_map_takes_the_skills_own_arguments(shapes_model, images):
    mapped = shapes_model.map("detect", images[:2], "shape", {"max_objects": 2}, progress=False)
    assert mapped == [shapes_model.detect(one, "shape", {"max_objects": 2}) for one in images[:2]]


def _limits(model: Model, max_tokens: int, explicit: bool = True) -> CallLimits:
    return CallLimits(foveal.engine.SamplingParams(max_tokens=max_tokens), explicit, model.config.max_model_len)


def test_a_bad_output_type_fails_before_any_image_is_asked_for(shapes_model):
    call = calls.generate(shapes_model.family, None, "x", {"type": "string", "pattern": "("})

    def images():
        raise AssertionError("the images were asked for before the output type compiled")

    with pytest.raises(SchemaError):
        shapes_model.family.prepare(call.task, images, _limits(shapes_model, 16))


def test_a_spatial_answer_never_holds_more_items_than_its_budget(shapes_model, image):
    family = shapes_model.family
    task = calls.detect(family, None, "shape", {"max_objects": 50}).task
    key = foveal.vision.image_key(image)
    one = family.item_bounds(task.spec).first
    for max_tokens in (one, 3 * one, 10 * one):
        prepared = family.prepare(task, lambda: ([image], key), _limits(shapes_model, max_tokens))
        assert isinstance(prepared, Prepared) and prepared.request.sampling.max_tokens == max_tokens
        assert 1 <= prepared.task.spec.max_objects <= family.item_bounds(task.spec).items_within(max_tokens)
    with pytest.raises(ValueError, match="cannot hold one detect item"):
        family.prepare(task, lambda: ([image], key), _limits(shapes_model, one - 1))


def test_read_is_pure(shapes_model, image):
    prepared = shapes_model._prepare(calls.detect(shapes_model.family, image, "shape", {"max_objects": 3}))
    output = shapes_model.engine.submit(prepared.request).result()
    assert prepared.read(output) == prepared.read(output)
