"""Decoded images within the model's pixel budget: reduced where the processor shrinks anyway, always given back."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from foveal.vision import PixelBudget, PixelBudgetTimeout

from .conftest import scene_image


def _jpeg(side: int) -> bytes:
    buffer = io.BytesIO()
    scene_image(3, (64, 64)).resize((side, side)).save(buffer, "JPEG", quality=80)
    return buffer.getvalue()


class Encoded:
    """Records the sizes of the images a family encodes."""

    def __init__(self, model, monkeypatch, fail: bool = False):
        self.sizes = []
        encode = model.family.encode

        def spy(task, images, key):
            self.sizes.append([im.size for im in images])
            if fail:
                raise RuntimeError("processor failed")
            return encode(task, images, key)

        monkeypatch.setattr(model.family, "encode", spy)


def test_a_large_image_is_decoded_reduced_for_a_fixed_size_processor(shapes_model, monkeypatch):
    target = shapes_model.family.image_min_size
    assert target is not None  # the embedded PaliGemma resizes every image to one size
    spy = Encoded(shapes_model, monkeypatch)
    result = shapes_model.detect(_jpeg(2048), "circle")
    (size,) = spy.sizes[0]
    assert target[0] <= size[0] < 2048 and target[1] <= size[1] < 2048
    assert "objects" in result and shapes_model.pixels.in_use == 0


def test_a_processor_whose_grid_follows_the_image_gets_it_in_full():
    from foveal.families.qwen_vl import QwenVLFamily

    assert QwenVLFamily.image_min_size.fget(object()) is None  # Qwen-VL's grid is the image's own


def test_the_budget_is_given_back_when_the_call_fails(shapes_model, monkeypatch):
    Encoded(shapes_model, monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="processor failed"):
        shapes_model.detect(_jpeg(256), "circle")
    assert shapes_model.pixels.in_use == 0


def test_a_full_budget_makes_a_call_wait_then_time_out(shapes_model, monkeypatch):
    monkeypatch.setattr(shapes_model, "pixels", PixelBudget(10_000, timeout_s=0.2))
    with shapes_model.pixels.acquire(10_000), pytest.raises(PixelBudgetTimeout):
        shapes_model.detect(Image.new("RGB", (64, 64)), "circle")
    assert shapes_model.pixels.in_use == 0
    assert "objects" in shapes_model.detect(Image.new("RGB", (64, 64)), "circle")  # served once free
