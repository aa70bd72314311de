"""Moondream 3 over the REST API through the official `moondream` client unchanged: point with spatial
references on /v1/point, and a fine-tune named as the client's finetune API names it
(`Finetune.model(step)` = `moondream3-preview/<finetune_id>@<step>`, sent as the body's `model`), served
from the model folder's adapters/<finetune_id>/<step>.pt. Over the moondream3-tiny fixture's weights."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request

import pytest
import torch
from PIL import Image

import foveal
from foveal.server import create_app
from foveal.server.background import BackgroundServer
from tests.models.moondream.test_md3_adapters import adapter_state, text_config
from tests.server.conftest import data_url

moondream = pytest.importorskip("moondream", reason="the moondream client is installed by .ci/run (--no-deps)")
from moondream.finetune import Finetune  # noqa: E402 - after the client's importorskip

OBJECT = "tok1011 tok77"
QUESTION = "tok1012 tok318 tok428 tok30"
TEXT = {"max_tokens": 8}
FINETUNE, STEP = "01J5Z3NDEKTSV4RRFFQ69G5FAV", 10


@pytest.fixture(scope="module")
def md3_model(shared_dir, tmp_path_factory):
    fixture = shared_dir / "fixtures" / "moondream3-tiny"
    if not fixture.is_dir():
        pytest.skip(f"the Moondream 3 fixture is absent: {fixture}")
    folder = tmp_path_factory.mktemp("md3-served")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).symlink_to(fixture / name)
    (folder / "adapters" / FINETUNE).mkdir(parents=True)
    state = adapter_state(text_config(fixture), seed=1, scale=0.5)
    torch.save({"lora_state_dict": state}, folder / "adapters" / FINETUNE / f"{STEP}.pt")
    with foveal.load(folder, device="cpu") as model:
        model.fixture = fixture
        yield model


@pytest.fixture(scope="module")
def md3_server(md3_model):
    with BackgroundServer(create_app(md3_model)) as url:
        yield url


@pytest.fixture(scope="module")
def image(md3_model):
    return Image.open(md3_model.fixture / "images" / "shapes_320x240.png").convert("RGB")


def _jpeg(image):
    """The client sends JPEG (quality 95); the SDK gets the same bytes for a like-for-like answer."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def _finetuned(md3_server):
    tune = Finetune(api_key="unused", endpoint="http://unused", finetune_id=FINETUNE, name="x", rank=4)
    assert tune.model(STEP) == f"moondream3-preview/{FINETUNE}@{STEP}"
    return moondream.vl(endpoint=f"{md3_server}/v1", model=tune.model(STEP))


def test_point_with_spatial_refs_through_the_client(md3_server, md3_model, image):
    client = moondream.vl(endpoint=f"{md3_server}/v1")
    for refs in ([[0.25, 0.75]], [[0.8, 0.3], [0.15, 0.35, 0.45, 0.9]]):
        got = client.point(image, OBJECT, spatial_refs=refs)
        want = md3_model.point(_jpeg(image), OBJECT, spatial_refs=refs)
        assert got == json.loads(json.dumps(want))
        assert got != client.point(image, OBJECT)  # the refs reached the model (its points' scores)


def test_a_finetune_named_as_the_client_names_it(md3_server, md3_model, image):
    tuned, plain = _finetuned(md3_server), moondream.vl(endpoint=f"{md3_server}/v1")
    adapter = {"adapter": f"{FINETUNE}@{STEP}"}
    calls = {
        "caption": (lambda c, s: c.caption(image, settings=s), lambda s: md3_model.caption(_jpeg(image), settings=s)),
        "query": (lambda c, s: c.query(image, QUESTION, settings=s),
                  lambda s: md3_model.query(_jpeg(image), QUESTION, settings=s)),
        "point": (lambda c, s: c.point(image, OBJECT, settings=s), lambda s: md3_model.point(_jpeg(image), OBJECT, settings=s)),
    }
    for name, (rest, sdk) in calls.items():
        settings = TEXT if name != "point" else {}
        got = rest(tuned, settings)
        assert got == json.loads(json.dumps(sdk({**settings, **adapter}))), name
        assert got != rest(plain, settings), name  # the adapter applied
        assert rest(tuned, {**settings, **adapter}) == got  # the same adapter named twice is one
    streamed = "".join(tuned.caption(image, stream=True, settings=TEXT)["caption"])
    assert streamed == md3_model.caption(_jpeg(image), settings={**TEXT, **adapter})["caption"]


def _post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


def _refused(url, body):
    with pytest.raises(urllib.error.HTTPError) as raised:
        _post(url, body)
    assert raised.value.code == 400
    return json.loads(raised.value.read())["error"]["message"]


def test_refusals(md3_server, image):
    url = data_url(image)
    caption = f"{md3_server}/v1/caption"
    assert "adapter 'nope@1' was not found" in _refused(caption, {"image_url": url, "model": "moondream3-preview/nope@1"})
    message = _refused(caption, {"image_url": url, "model": "moondream3-preview/../../etc@1"})
    assert "neither a model's name nor a fine-tune's" in message
    body = {"image_url": url, "model": f"moondream3-preview/{FINETUNE}@{STEP}", "settings": {"adapter": "other@2"}}
    assert "names adapter" in _refused(caption, body)
    gaze = {"image_url": url, "eye": [0.3, 0.4], "model": f"moondream3-preview/{FINETUNE}@{STEP}"}
    assert "takes no settings" in _refused(f"{md3_server}/v1/gaze", gaze)
    # a plain model name, or a hub id, is the served model
    assert "caption" in _post(caption, {"image_url": url, "model": "moondream/moondream3-preview", "settings": TEXT})
