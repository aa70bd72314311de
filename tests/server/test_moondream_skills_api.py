"""Moondream 2's remaining skills over the REST API, through the official `moondream` client unchanged:
grounded reasoning and spatial refs on /v1/query, /v1/gaze, and the clear refusals (spatial refs on
point, /v1/segment on a model without segment, reasoning on a model without it). Served over the reference fixture's folder."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import pytest
from PIL import Image

import foveal
from foveal.server import create_app
from foveal.server.background import BackgroundServer
from tests.server.conftest import data_url, scene

moondream = pytest.importorskip("moondream", reason="the moondream client is installed by .ci/run (--no-deps)")

QUESTION = "tok588 tok900 tok469 tok382"
GREEDY = {"max_tokens": 12}


@pytest.fixture(scope="module")
def md_model(shared_dir):
    folder = shared_dir / "fixtures" / "moondream2-tiny"
    if not folder.is_dir():
        pytest.skip(f"the Moondream fixture is absent: {folder}")
    with foveal.load(folder, device="cpu") as model:
        model.fixture = folder
        yield model


@pytest.fixture(scope="module")
def md_server(md_model):
    with BackgroundServer(create_app(md_model)) as url:
        yield url


@pytest.fixture(scope="module")
def client(md_server):
    return moondream.vl(endpoint=f"{md_server}/v1")


@pytest.fixture(scope="module")
def image(md_model):
    return Image.open(md_model.fixture / "images" / "small_64x64.png").convert("RGB")


def _jpeg(image):
    """The client sends JPEG (quality 95); the SDK gets the same bytes for a like-for-like answer."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def test_reasoning_through_the_client(client, md_model, image):
    got = client.query(image, QUESTION, reasoning=True, settings=GREEDY)
    want = md_model.query(_jpeg(image), QUESTION, reasoning=True, settings=GREEDY)
    assert got == json.loads(json.dumps(want))
    assert set(got) == {"reasoning", "answer"} and set(got["reasoning"]) == {"text", "grounding"}
    streamed = client.query(image, QUESTION, reasoning=True, stream=True, settings=GREEDY)["answer"]
    assert "".join(streamed) == want["answer"]


def test_spatial_refs_through_the_client(client, md_model, image):
    refs = [[0.8, 0.3], [0.15, 0.35, 0.45, 0.9]]
    got = client.query(image, QUESTION, spatial_refs=refs, settings=GREEDY)
    assert got == md_model.query(_jpeg(image), QUESTION, spatial_refs=refs, settings=GREEDY)


def test_gaze_route(md_server, md_model, image):
    got = _post(f"{md_server}/v1/gaze", {"image_url": data_url(Image.open(io.BytesIO(_jpeg(image)))), "eye": [0.3, 0.4]})
    want = md_model.detect_gaze(Image.open(io.BytesIO(_jpeg(image))), eye=(0.3, 0.4))
    assert got.pop("finish_reason") == "stop" and set(got.pop("metrics")) >= {"input_tokens", "ttft_ms"}
    assert got == json.loads(json.dumps(want))


def _refused(call):
    with pytest.raises(urllib.error.HTTPError) as raised:
        call()
    assert raised.value.code == 400
    return json.loads(raised.value.read())["error"]["message"]


def test_refusals_are_400s_that_say_why(client, md_server, server, image):
    assert "spatial_refs on point" in _refused(lambda: client.point(image, "tok1011", spatial_refs=[[0.5, 0.5]]))
    assert "moondream model does not support segment" in _refused(lambda: client.segment(image, "tok1011"))
    message = _refused(lambda: client.query(image, QUESTION, reasoning=True, spatial_refs=[[0.5, 0.5]]))
    assert "spatial_refs together with reasoning" in message
    shapes = moondream.vl(endpoint=f"{server}/v1")
    message = _refused(lambda: shapes.query(scene(1), "how many circles?", reasoning=True))
    assert "shapes model does not support reasoning; it supports caption, query" in message
    assert "does not support detect_gaze" in _refused(
        lambda: _post(f"{server}/v1/gaze", {"image_url": data_url(scene(1)), "eye": [0.5, 0.5]})
    )


def test_chat_with_reasoning_through_the_client(client, md_model, image):
    """The client's chat(reasoning=True) posts to /v1/chat/completions: Moondream answers it with
    query(reasoning=True), the reasoning in the client's `reasoning` / `reasoning_details` fields."""
    url = "data:image/jpeg;base64," + __import__("base64").b64encode(_jpeg(image)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": QUESTION}]}]
    got = client.chat(messages, reasoning=True, settings=GREEDY)
    want = md_model.query(_jpeg(image), QUESTION, reasoning=True, settings=GREEDY)
    message = got["message"]
    assert message["content"] == want["answer"]
    assert message["reasoning"] == want["reasoning"]["text"]
    assert message["reasoning_details"]["grounding"] == json.loads(json.dumps(want["reasoning"]["grounding"]))
    assert "".join(client.chat(messages, reasoning=True, stream=True, settings=GREEDY)["message"]) == want["answer"]
    plain = client.chat(messages, settings=GREEDY)["message"]
    assert "reasoning" not in plain and plain["content"]
    with pytest.raises(urllib.error.HTTPError) as error:
        client.chat(messages + [{"role": "user", "content": "and?"}], reasoning=True)
    assert error.value.code == 400 and "single user message" in error.value.read().decode()


def test_chat_reasoning_is_refused_where_the_model_has_none(tmp_path):
    with foveal.load() as shapes, BackgroundServer(create_app(shapes)) as url:
        body = {"messages": [{"role": "user", "content": "hi"}], "reasoning": True}
        with pytest.raises(urllib.error.HTTPError) as error:
            _post(f"{url}/v1/chat/completions", body)
        assert error.value.code == 400
        assert "reasoning is not supported by this model (shapes)" in error.value.read().decode()
