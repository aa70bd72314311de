"""Moondream's REST API against the official `moondream` client, unchanged: same answers as the SDK
in-process, streams in the client's SSE format, X-Moondream-Auth."""

from __future__ import annotations

import urllib.error

import pytest

from foveal.server import ServerConfig
from tests.server.conftest import all_pages_free, scene

moondream = pytest.importorskip(
    "moondream", reason="the moondream client is installed by .ci/run (--no-deps)"
)


@pytest.fixture(scope="module")
def client(server):
    return moondream.vl(endpoint=f"{server}/v1")


def test_skills_answer_what_the_sdk_answers(client, model):
    image = scene(3)
    assert client.detect(image, "circle") == model.detect(_jpeg(image), "circle")
    assert client.point(image, "shape") == model.point(_jpeg(image), "shape")
    assert client.caption(image, length="short") == model.caption(_jpeg(image), "short")
    assert client.query(image, "how many circles?") == model.query(_jpeg(image), "how many circles?")
    assert (
        client.detect(image, "circle", settings={"max_objects": 1})["objects"]
        == model.detect(_jpeg(image), "circle", {"max_objects": 1})["objects"]
    )
    assert all_pages_free(model)


def test_streams_join_to_the_whole_answer(client, model):
    image = scene(5)
    whole = client.caption(image)["caption"]
    chunks = list(client.caption(image, stream=True)["caption"])
    assert len(chunks) > 1 and "".join(chunks) == whole
    answer = client.query(image, "what colour is the square?")["answer"]
    assert "".join(client.query(image, "what colour is the square?", stream=True)["answer"]) == answer
    assert all_pages_free(model)


def test_detect_finds_the_scene_objects(client):
    """The embedded model is meaningful on its world: the box lies on the one matching object."""
    from foveal.vision import scenes

    s = scenes.generate_scene(11, 160)
    target = s.objects[0]
    found = client.detect(scenes.render(s), target.phrase())["objects"]
    truth = [o.box(s.width, s.height) for o in scenes.objects_matching(s, target.phrase())]
    assert len(found) == len(truth) >= 1


def test_bad_settings_are_a_400_that_says_what_to_fix(client):
    with pytest.raises(urllib.error.HTTPError) as raised:
        client.detect(scene(0), "circle", settings={"temprature": 0.5})
    assert raised.value.code == 400
    assert "did you mean 'temperature'" in raised.value.read().decode()


def test_api_key_is_required_when_set(serve):
    url = serve(ServerConfig(api_key="sesame"))
    assert moondream.vl(endpoint=f"{url}/v1", api_key="sesame").point(scene(1), "shape")["points"]
    for key in (None, "wrong"):
        with pytest.raises(urllib.error.HTTPError) as raised:
            moondream.vl(endpoint=f"{url}/v1", api_key=key).point(scene(1), "shape")
        assert raised.value.code == 401


def _jpeg(image):
    """The client sends JPEG (quality 95); the SDK gets the same bytes for a like-for-like answer."""
    import io

    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()
