"""Tiny random models for the SDK tests, built once per session (nothing is downloaded).

The checkpoints come from `foveal.testing.tiny`, the builders the model tests use too.

- `paligemma_folder`: a tiny PaliGemma (its processor adds <loc>/<seg> tokens): PaliGemma skills.
- `shapes_folder`: the same checkpoint plus a `foveal.json` (32 location bins): the shapes skills
  of the embedded model.
- `llama_folder`: a tiny text-only Llama: chat skills, no image skills.
- `idefics3_folder`: a tiny Idefics3: chat skills of a vision family, JSON spatial answers.

Random weights give garbage text, but every constrained answer is valid by construction; the
tests assert exactly that.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import foveal
from foveal.families.shapes.format import ShapesFormat
from foveal.testing import tiny


def scene_image(seed: int = 0, size: tuple[int, int] = (48, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="session")
def builders():
    """`foveal.testing.tiny`: train_tokenizer, build_paligemma, build_llama, ..."""
    return tiny


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sdk_models")


@pytest.fixture(scope="session")
def paligemma_folder(model_root) -> Path:
    return tiny.build_paligemma(model_root / "paligemma")


@pytest.fixture(scope="session")
def shapes_folder(model_root, paligemma_folder) -> Path:
    folder = model_root / "shapes"
    shutil.copytree(paligemma_folder, folder)
    ShapesFormat(n_bins=32).save(folder)
    return folder


@pytest.fixture(scope="session")
def llama_folder(model_root) -> Path:
    return tiny.build_llama(model_root / "llama")


@pytest.fixture(scope="session")
def idefics3_folder(model_root) -> Path:
    return tiny.build("idefics3", model_root / "idefics3")


def _load(folder: Path, max_model_len: int = 256):
    return foveal.load(folder, device="cpu", max_batch_size=8, max_model_len=max_model_len)


@pytest.fixture(scope="session")
def shapes_model(shapes_folder):
    model = _load(shapes_folder)
    yield model
    model.close()


@pytest.fixture(scope="session")
def paligemma_model(paligemma_folder):
    model = _load(paligemma_folder)
    yield model
    model.close()


@pytest.fixture(scope="session")
def llama_model(llama_folder):
    model = _load(llama_folder, 512)  # JSON answers are long in a 300-token vocabulary
    yield model
    model.close()


@pytest.fixture(scope="session")
def idefics3_model(idefics3_folder):
    model = _load(idefics3_folder, 512)  # a vision chat family: chat prompts with an image placeholder
    yield model
    model.close()


@pytest.fixture(scope="session")
def image() -> Image.Image:
    return scene_image(0)


@pytest.fixture(scope="session")
def images() -> list[Image.Image]:
    return [scene_image(seed) for seed in range(4)]
