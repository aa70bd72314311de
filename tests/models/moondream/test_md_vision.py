"""Moondream's vision side against the reference fixture (fp32): tilings, crops, features, image embeddings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from foveal.families.moondream import vision
from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.weights import load_weights

from .conftest import tolerance

IMAGES = ("gradient_300x200", "multicrop_900x500", "small_64x64")


@pytest.fixture(scope="module")
def weights(md_dir):
    import json

    config = MoondreamConfig.from_dict(json.loads((md_dir / "config.json").read_text())["config"])
    return load_weights(md_dir / "model.safetensors", config, torch.device("cpu"), torch.float32)


def test_tiling_rule():
    assert vision.tiling(200, 300) == (1, 1)
    assert vision.tiling(500, 900) == (2, 4)
    assert vision.tiling(4000, 4000) == (3, 3)  # 15 x 15 windows scaled down to at most 12 crops
    assert vision.tiling(600, 2000) == (1, 6)


def test_pixel_table_is_the_bf16_chain(md_figures):
    ref = torch.tensor(md_figures["preprocessing"]["pixel_lut_uint8_to_normalized"])
    assert torch.equal(vision.pixel_table(), ref)
    # float32 normalization is a real difference the table must not have
    plain = torch.arange(256) / 255.0 * 2 - 1
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("name", IMAGES)
def test_crops_exact(md_dir, md_figures, name):
    info = md_figures["images"][name]
    crops, tiling = vision.crops(Image.open(md_dir / info["image"]["file"]))
    assert list(tiling) == info["crops"]["tiling"]
    assert len(crops) == len(info["crops"]["files"])
    for crop, file in zip(crops, info["crops"]["files"], strict=True):
        assert np.array_equal(crop, np.asarray(Image.open(md_dir / file).convert("RGB")))


@pytest.mark.parametrize("name", IMAGES)
def test_features_and_embeddings(md_dir, md_figures, md_tensors, weights, name):
    info = md_figures["images"][name]
    crops, tiling = vision.crops(Image.open(md_dir / info["image"]["file"]))
    encoder = weights.model.vision
    with torch.inference_mode():
        features = encoder.features(vision.normalize(crops))
        pooled = vision.pool_tiles(features[1:], tiling).view(27, 27, -1)
        (embedding,) = encoder.embed([vision.normalize(crops)], [tiling])
    checks = [
        (features[0], f"{name}.vis_enc.global"),
        (pooled, f"{name}.vis_enc.local_pooled"),
        (embedding, f"{name}.img_emb"),
    ]
    if tiling != (1, 1):
        checks.append((vision.stitch_tiles(features[1:], tiling), f"{name}.vis_enc.local_reconstructed"))
    for got, key in checks:
        ref = md_tensors[key]
        assert got.shape == ref.shape, key
        assert (got - ref).abs().max() <= tolerance(ref), key
