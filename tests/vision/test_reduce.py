"""Reduced decodes (`load_image(..., min_size=)`): what the processor gets matches the full decode's.

Tolerance, stated once: the reduced and the full decode, each resized to the target the way the
model's processor does (PIL, bicubic), differ by at most MEAN_TOLERANCE grey levels on average and
MAX_TOLERANCE at any pixel and channel (measured worst here: 0.9 and 4, on textured content just
past a reduction step; smooth content and scenes stay under 0.1 on average).
"""

from __future__ import annotations

import io
import json
import random
from importlib import resources

import numpy as np
import pytest
from PIL import Image

from foveal.vision import image_key, load_image, open_image, scenes
from foveal.vision.images import REDUCE_GAP, ImageError

MEAN_TOLERANCE = 1.0
MAX_TOLERANCE = 6
BICUBIC = Image.Resampling.BICUBIC


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def photo(width: int, height: int, cells: int = 16, seed: int = 0) -> Image.Image:
    """Smooth random texture (random cells, bicubic-upsampled): detail at every scale down to `cells`."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(height // cells, 2), max(width // cells, 2), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), BICUBIC)


def scene(width: int, height: int) -> Image.Image:
    return scenes.render(scenes.generate_scene(3, width, height))


def processed(image: Image.Image, target: tuple[int, int]) -> np.ndarray:
    return np.asarray(image.resize(target, BICUBIC), dtype=int)


def assert_close(full: Image.Image, reduced: Image.Image, target: tuple[int, int]) -> None:
    diff = np.abs(processed(full, target) - processed(reduced, target))
    assert diff.mean() <= MEAN_TOLERANCE, f"mean difference {diff.mean():.2f} grey levels"
    assert diff.max() <= MAX_TOLERANCE, f"max difference {diff.max()} grey levels"


def at_least(size: tuple[int, int], source: tuple[int, int], target: tuple[int, int]) -> bool:
    """Invariant 5: each side at least REDUCE_GAP x the target's, or the source's side when smaller."""
    return all(s >= min(REDUCE_GAP * t, o) for s, o, t in zip(size, source, target, strict=True))


# what the processor gets


@pytest.mark.parametrize("target", [(64, 64), (100, 40)])
@pytest.mark.parametrize("size", [(1001, 999), (1600, 1200)])
@pytest.mark.parametrize("content", ["photo", "scene"])
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_reduced_decode_processes_like_the_full_decode(fmt, content, size, target):
    image = photo(*size) if content == "photo" else scene(*size)
    data = encode(image, fmt, **({"quality": 90} if fmt == "JPEG" else {"compress_level": 1}))
    full, reduced = load_image(data), load_image(data, min_size=target)
    assert reduced.mode == "RGB"
    assert reduced.width * reduced.height * 4 <= full.width * full.height, "the decode must be reduced"
    assert at_least(reduced.size, full.size, target)
    assert_close(full, reduced, target)


def test_embedded_processor_gets_nearly_the_same_tensor():
    """The embedded model's own image processor (its preprocessor_config.json) on both decodes."""
    transformers = pytest.importorskip("transformers")
    folder = resources.files("foveal") / "embedded"
    config = json.loads((folder / "preprocessor_config.json").read_text())
    processor = transformers.AutoImageProcessor.from_pretrained(str(folder))
    target = (config["size"]["width"], config["size"]["height"])
    data = encode(photo(2400, 1800, cells=8), "JPEG", quality=90)
    full, reduced = load_image(data), load_image(data, min_size=target)
    assert reduced.width <= full.width // 8
    values = [processor(images=[im], return_tensors="np")["pixel_values"][0] for im in (full, reduced)]
    # pixel_values = (x / 255 - mean) / std: one grey level is 1 / (255 * std).
    levels = np.abs(values[0] - values[1]) * 255 * np.asarray(config["image_std"])[:, None, None]
    assert levels.mean() <= MEAN_TOLERANCE
    assert levels.max() <= MAX_TOLERANCE + 0.5  # the processor's float resize rounds on its own


def test_target_sides_are_never_undercut():
    rng = random.Random(0)
    for _ in range(40):
        source = (rng.randint(40, 900), rng.randint(40, 900))
        target = (rng.randint(1, 120), rng.randint(1, 120))
        for fmt in ("JPEG", "PNG"):
            data = encode(Image.new("RGB", source, (90, 140, 200)), fmt)
            out = load_image(data, min_size=target)
            assert at_least(out.size, source, target), (source, target, out.size)


def test_smaller_than_the_target_is_left_alone():
    data = encode(photo(150, 100), "JPEG")
    assert load_image(data, min_size=(64, 64)).size == (150, 100)
    assert np.array_equal(np.asarray(load_image(data, min_size=(64, 64))), np.asarray(load_image(data)))


def test_jpeg_is_decoded_small_by_the_decoder_itself():
    data = encode(photo(2048, 1536), "JPEG")
    opened = open_image(data, min_size=(64, 64))
    assert opened.decode_pixels == (2048 // 8) * (1536 // 8), "DCT scaling at 1/8 before decoding"
    with opened:
        assert opened.decode().width <= 2048 // 8
    assert open_image(data).decode_pixels == 2048 * 1536


def test_formats_decoded_in_full_count_the_full_source():
    # A PNG must be decoded whole before it can be reduced; a progressive JPEG's decoder buffers the
    # whole image's coefficients at any scale: the budget must count the source's pixels for both.
    image = photo(1024, 768)
    for data in (encode(image, "PNG"), encode(image, "JPEG", progressive=True)):
        assert open_image(data, min_size=(64, 64)).decode_pixels == 1024 * 768
        assert load_image(data, min_size=(64, 64)).width <= 1024 // 4


def test_sideways_exif_orientation_reduces_against_the_upright_target():
    array = np.zeros((400, 1600, 3), np.uint8)  # stored 1600 wide, 400 high; red left half, blue right
    array[:, :800] = (255, 0, 0)
    array[:, 800:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise: 400 wide, 1600 high, red on top
    data = encode(Image.fromarray(array), "JPEG", exif=exif, quality=95)
    full = load_image(data)
    assert full.size == (400, 1600)
    wide = load_image(data, min_size=(100, 20))  # needs 300 upright columns: the stored 400 rows stay
    assert wide.width >= 300 and wide.height >= 60
    tall = load_image(data, min_size=(20, 100))
    assert tall.width < 400 and at_least(tall.size, full.size, (20, 100))
    top, bottom = np.asarray(tall)[5, tall.width // 2].astype(int), np.asarray(tall)[-5, tall.width // 2]
    assert top[0] > 200 and top[2] < 60 and bottom[2] > 200, "the red half must end on top"
    assert_close(full, tall, (20, 100))


def test_transparency_palette_and_cmyk_reduce_like_full_decodes():
    base = photo(900, 700, cells=8)
    rgba = base.convert("RGBA")
    alpha = np.zeros((700, 900), np.uint8)
    alpha[100:600, 150:750] = 255  # an opaque window in a transparent (white-composited) frame
    rgba.putalpha(Image.fromarray(alpha))
    inputs = {
        "RGBA png": encode(rgba, "PNG"),
        "palette gif": encode(base.convert("P"), "GIF"),
        "CMYK jpeg": encode(base.convert("CMYK"), "JPEG", quality=95),
        "grey png": encode(base.convert("L"), "PNG"),
    }
    for name, data in inputs.items():
        full, reduced = load_image(data), load_image(data, min_size=(48, 48))
        assert reduced.width < full.width // 2, name
        assert_close(full, reduced, (48, 48))


def test_pil_and_numpy_inputs_reduce_and_stay_untouched():
    image = photo(1200, 900)
    before = np.asarray(image).copy()
    for source in (image, np.asarray(image)):
        reduced = load_image(source, min_size=(64, 64))
        assert reduced.width <= 1200 // 4
        assert_close(image, reduced, (64, 64))
    assert np.array_equal(np.asarray(image), before)


# image_key on reduced decodes


def test_same_image_same_target_same_key(tmp_path):
    data = encode(photo(1600, 1200), "JPEG")
    (tmp_path / "a.jpg").write_bytes(data)
    keys = {image_key(load_image(source, min_size=(64, 64))) for source in (data, data, tmp_path / "a.jpg")}
    assert len(keys) == 1


def test_different_images_or_targets_get_different_keys():
    one = encode(photo(1600, 1200, seed=1), "JPEG")
    other = encode(photo(1600, 1200, seed=2), "JPEG")
    keys = [
        image_key(load_image(one, min_size=(64, 64))),
        image_key(load_image(other, min_size=(64, 64))),
        image_key(load_image(one, min_size=(128, 128))),
        image_key(load_image(one)),  # the full decode is another image to the processor
    ]
    assert len(set(keys)) == len(keys)
    # A target that leaves no room to reduce gives the full decode: the same pixels, the same key.
    assert image_key(load_image(one, min_size=(224, 224))) == keys[-1]


# checks kept


@pytest.mark.parametrize("bad", [64, (64,), (64, 0), (64, -1), (64.0, 64), ("64", 64), (True, 64)])
def test_bad_min_size_is_refused(bad):
    with pytest.raises(ImageError, match=r"min_size must be \(width, height\)"):
        load_image(Image.new("RGB", (8, 8)), min_size=bad)


def test_bomb_guard_and_corruption_still_apply_with_a_target():
    from tests.vision.test_images import png_header_only

    with pytest.raises(ImageError, match="over the limit"):
        open_image(png_header_only(8000, 8000), min_size=(64, 64))
    data = encode(photo(1024, 768), "JPEG")
    with pytest.raises(ImageError, match="corrupt"):
        load_image(data[: len(data) // 2], min_size=(64, 64))
    rng = random.Random(7)
    for _ in range(40):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        try:
            out = load_image(
                bytes(damaged[: rng.randint(len(damaged) // 2, len(damaged))]), min_size=(64, 64)
            )
        except ImageError:
            continue
        assert out.mode == "RGB"


def test_an_opened_image_decodes_once():
    opened = open_image(encode(photo(64, 64), "PNG"))
    opened.decode()
    with pytest.raises(ImageError, match="already decoded"):
        opened.decode()
