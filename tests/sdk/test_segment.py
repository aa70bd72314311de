"""The segment skill's surface (sdk: calls.segment, Model.segment / asegment, SegmentResult and its
streams): refused where the family has none, the client 2.6.1's arguments, results checked where
they are made, and the stream form (bbox, path chunks, the completed result), on the tiny shapes
model answering through foveal.testing.segment's stand-in."""

from __future__ import annotations

import asyncio

import pytest

from foveal.families.base import UnsupportedSkill
from foveal.results import SegmentResult, SegmentStream, Usage
from foveal.testing.segment import outline, segmenting
from foveal.vision.svg import SvgPathError

SHORT = {"max_tokens": 12, "temperature": 0.0}


def _pages_free(model) -> bool:
    return model.engine.wait_idle(10) and model.engine.free_pages() == model.engine.config.num_pages


def test_a_model_without_segment_refuses_it_before_any_work(shapes_model, llama_model, image):
    with pytest.raises(UnsupportedSkill, match="does not support segment; it supports caption"):
        shapes_model.segment(image, "circle")
    with pytest.raises(UnsupportedSkill, match="does not support segment"):
        asyncio.run(shapes_model.asegment(image, "circle", stream=True))
    with pytest.raises(ValueError, match="text-only: segment needs an image"):
        llama_model.segment(None, "circle")
    assert isinstance(UnsupportedSkill("x"), ValueError)


def test_arguments_are_checked_first(shapes_model, image):
    with segmenting(shapes_model.family):
        with pytest.raises(ValueError, match="object is empty"):
            shapes_model.segment(image, " ")
        with pytest.raises(TypeError, match="stream must be True or False"):
            shapes_model.segment(image, "circle", None, {"max_tokens": 3})  # settings where stream goes
        with pytest.raises(ValueError, match=r"spatial_refs\[0\]"):
            shapes_model.segment(image, "circle", [[2, 0]])
        with pytest.raises(ValueError, match="segment needs an image"):
            shapes_model.segment(None, "circle")
    with pytest.raises(UnsupportedSkill, match="does not support segment"):  # refs on a model without segment
        shapes_model.segment(image, "circle", [[0.5, 0.5]])


def test_segment_answers_a_path_and_its_box(shapes_model, image):
    with segmenting(shapes_model.family):
        result = shapes_model.segment(image, "circle", [[0.5, 0.5]], settings=SHORT)
        caption = shapes_model.caption(image, "short", settings=SHORT)["caption"]
    assert isinstance(result, SegmentResult) and set(result) == {"path", "bbox"}
    assert dict(result) == outline(caption)
    assert result.usage.prompt_tokens > 0 and result.usage.completion_tokens >= 1
    assert result.annotated().size == image.size


def test_the_stream_sends_the_box_then_path_chunks_then_the_result(shapes_model, image):
    with segmenting(shapes_model.family):
        whole = shapes_model.segment(image, "circle", settings=SHORT)
        stream = shapes_model.segment(image, "circle", stream=True, settings=SHORT)
        assert isinstance(stream, SegmentStream)
        updates = list(stream)
    assert updates[0] == {"bbox": whole["bbox"]}
    chunks = [u["chunk"] for u in updates[1:-1]]
    assert chunks and all(set(u) == {"chunk"} for u in updates[1:-1])
    assert "".join(chunks) == whole["path"]
    assert updates[-1] == {"path": whole["path"], "bbox": whole["bbox"], "completed": True}
    assert stream.result == whole and stream.usage == whole.usage


def test_the_async_twin_streams_alike(shapes_model, image):
    async def both():
        with segmenting(shapes_model.family):
            whole = await shapes_model.asegment(image, "circle", settings=SHORT)
            stream = await shapes_model.asegment(image, "circle", stream=True, settings=SHORT)
            return whole, [u async for u in stream], stream

    whole, updates, stream = asyncio.run(both())
    assert isinstance(whole, SegmentResult)
    assert updates[0] == {"bbox": whole["bbox"]} and updates[-1]["completed"] is True
    assert "".join(u["chunk"] for u in updates[1:-1]) == whole["path"] == stream.result["path"]


def test_a_stream_left_early_stops_its_request(shapes_model, image):
    with segmenting(shapes_model.family):
        stream = shapes_model.segment(image, "circle", stream=True, settings={"max_tokens": 200})
        for update in stream:
            assert "bbox" in update
            break
    assert _pages_free(shapes_model)


def test_results_are_checked_where_they_are_made():
    assert SegmentResult("M 0 0 L 1 1 Z", None) == {"path": "M 0 0 L 1 1 Z", "bbox": None}
    with pytest.raises(SvgPathError, match="lies outside"):
        SegmentResult("M 0 0 L 1.5 1", None)
    with pytest.raises(SvgPathError, match="must start with M"):
        SegmentResult("L 0 0", None)
    with pytest.raises(ValueError, match="coordinates are numbers in"):
        SegmentResult("M 0 0", {"x_min": 0, "y_min": 0, "x_max": 2, "y_max": 1})


def test_usage_of_two_requests_adds_up():
    reasoning = Usage(10, 4, "stop", prefill_time_ms=5.0, decode_time_ms=3.0, ttft_ms=6.0)
    answer = Usage(16, 2, "length", prefill_time_ms=1.0, decode_time_ms=2.0, ttft_ms=1.5)
    both = reasoning.then(answer)
    assert both == Usage(10, 6, "length")  # the times are measurements: equality ignores them
    assert (both.prefill_time_ms, both.decode_time_ms, both.ttft_ms) == (5.0, 6.5, 6.0)


def test_every_result_carries_its_timings(shapes_model, image):
    usage = shapes_model.detect(image, "circle", {"max_objects": 2}).usage
    assert usage.ttft_ms >= usage.prefill_time_ms > 0 and usage.decode_time_ms >= 0
    stream = shapes_model.caption(image, "short", stream=True, settings=SHORT)["caption"]
    "".join(stream)
    assert stream.usage.ttft_ms > 0
