"""Fixtures of the server tests: the embedded model behind a real uvicorn server on a free loopback
port (in a thread of the test process), and helpers to build images and data URLs.

- `model`: `foveal.load()` once per session (the embedded shapes model: its answers are meaningful).
- `server`: a server over `model` with the default config; `serve(config)` starts another one over
  the same model (API key, small limits) for the test that needs it.
- `random_model` / `random_server`: a tiny random-weight PaliGemma, whose answers run to max_tokens
  (random weights rarely say EOS): the long generations that disconnect tests cut short.
"""

from __future__ import annotations

import base64
import contextlib
import io
import shutil

import pytest
from PIL import Image

import foveal
from foveal.families.shapes.format import ShapesFormat
from foveal.server import ServerConfig, create_app
from foveal.server.background import BackgroundServer
from foveal.testing import tiny
from foveal.vision import scenes


def scene(seed: int = 0, size: int = 160) -> Image.Image:
    return scenes.render(scenes.generate_scene(seed, size))


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def all_pages_free(model: foveal.Model, timeout: float = 10.0) -> bool:
    return model.engine.wait_idle(timeout) and model.engine.free_pages() == model.engine.config.num_pages


@pytest.fixture(scope="session")
def model():
    loaded = foveal.load(device="cpu")
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def server(model):
    with BackgroundServer(create_app(model)) as url:
        yield url


@pytest.fixture(scope="session")
def serve(model):
    """serve(config) -> url of a server over the session's model with that config (stopped at the end)."""
    with contextlib.ExitStack() as stack:
        yield lambda config: stack.enter_context(BackgroundServer(create_app(model, config=config)))


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("server_models") / "shapes"
    shutil.copytree(tiny.build_paligemma(folder.parent / "paligemma"), folder)
    ShapesFormat(n_bins=32).save(folder)
    loaded = foveal.load(folder, device="cpu", max_batch_size=8, max_model_len=512)
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def random_server(random_model):
    with BackgroundServer(create_app(random_model, config=ServerConfig(max_queue=2))) as url:
        yield url
