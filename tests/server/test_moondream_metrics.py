"""Moondream's API metrics and the segment route, against the official `moondream` client unchanged:
every answer carries `finish_reason` and `metrics` (input/output tokens, prefill/decode/ttft ms) in
the body and at the end of a stream, as Moondream's API does; /v1/segment answers the client's
segment and its stream (bbox, path chunks, the final path), and is a 400 where the model has none."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from foveal.testing.segment import segmenting
from tests.server.conftest import all_pages_free, data_url, scene

moondream = pytest.importorskip("moondream", reason="the moondream client is installed by .ci/run (--no-deps)")

METRICS = {"input_tokens", "output_tokens", "prefill_time_ms", "decode_time_ms", "ttft_ms"}
SHORT = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    return moondream.vl(endpoint=f"{server}/v1")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def _events(url: str, body: dict) -> list[dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return [json.loads(line[6:]) for line in response.read().decode().splitlines() if line.startswith("data: ")]


def _check_metrics(metrics: dict, model_answer) -> None:
    assert set(metrics) == METRICS
    assert metrics["input_tokens"] == model_answer.usage.prompt_tokens
    assert metrics["output_tokens"] == model_answer.usage.completion_tokens
    assert metrics["ttft_ms"] >= metrics["prefill_time_ms"] > 0 and metrics["decode_time_ms"] >= 0


def test_every_answer_carries_its_metrics_and_finish_reason(server, model):
    image = data_url(scene(3))
    for path, body, call in (
        ("detect", {"object": "circle"}, lambda: model.detect(scene(3), "circle")),
        ("point", {"object": "shape"}, lambda: model.point(scene(3), "shape")),
        ("caption", {"length": "short"}, lambda: model.caption(scene(3), "short")),
        ("query", {"question": "how many circles?"}, lambda: model.query(scene(3), "how many circles?")),
        ("caption", {"settings": {"max_tokens": 2}}, lambda: model.caption(scene(3), settings={"max_tokens": 2})),
    ):
        got = _post(f"{server}/v1/{path}", {"image_url": image, **body})
        want = call()
        assert {k: v for k, v in got.items() if k not in ("finish_reason", "metrics")} == json.loads(json.dumps(want))
        assert got["finish_reason"] == ("length" if want.usage.finish_reason == "length" else "stop")
        _check_metrics(got["metrics"], want)
    assert got["finish_reason"] == "length"  # two tokens of a caption


def test_a_stream_ends_with_its_metrics(server, client, model):
    image = scene(5)
    whole = model.caption(image, "normal")
    events = _events(f"{server}/v1/caption", {"image_url": data_url(image), "stream": True})
    *chunks, final = events
    assert all(set(e) == {"chunk"} for e in chunks) and "".join(e["chunk"] for e in chunks) == whole["caption"]
    assert final["completed"] is True and final["caption"] == whole["caption"] and final["finish_reason"] == "stop"
    _check_metrics(final["metrics"], whole)
    # the client reads the chunks and stops at the completed event, as before
    assert "".join(client.caption(image, stream=True)["caption"]) == client.caption(image)["caption"]
    assert all_pages_free(model)


def test_segment_is_a_400_on_a_model_without_it(client, server):
    with pytest.raises(urllib.error.HTTPError) as raised:
        client.segment(scene(1), "circle")
    assert raised.value.code == 400
    assert "does not support segment" in json.loads(raised.value.read())["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as raised:
        list(client.segment(scene(1), "circle", stream=True))
    assert raised.value.code == 400


def test_segment_through_the_client(client, server, model):
    image = scene(2)
    with segmenting(model.family):
        want = model.segment(_jpeg(image), "circle", settings=SHORT)
        got = client.segment(image, "circle", spatial_refs=[[0.5, 0.5]], settings=SHORT)
        updates = list(client.segment(image, "circle", stream=True, settings=SHORT))
        body = _post(f"{server}/v1/segment", {"image_url": data_url(image, "JPEG"), "object": "circle", "settings": SHORT})
        events = _events(
            f"{server}/v1/segment", {"image_url": data_url(image), "object": "circle", "stream": True, "settings": SHORT}
        )
    assert got == json.loads(json.dumps(want))
    assert updates[0] == {"bbox": want["bbox"]}
    assert "".join(u["chunk"] for u in updates[1:-1]) == want["path"]
    assert updates[-1] == {"path": want["path"], "bbox": want["bbox"], "completed": True}
    assert set(body) == {"path", "bbox", "finish_reason", "metrics"} and body["finish_reason"] in ("stop", "length")
    assert [e["type"] for e in events][:1] == ["bbox"] and events[-1]["type"] == "final"
    assert set(events[-1]) == {"type", "path", "bbox", "completed", "finish_reason", "metrics"}
    assert set(events[-1]["metrics"]) == METRICS
    assert all_pages_free(model)


def _jpeg(image):
    """The client sends JPEG (quality 95); the SDK gets the same bytes for a like-for-like answer."""
    import io

    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()
