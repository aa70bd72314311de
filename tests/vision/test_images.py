"""load_image: every accepted input type, the conversions, the bomb guard, and every refused input."""

from __future__ import annotations

import hashlib
import io
import random
import struct
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from foveal.vision.images import DEFAULT_MAX_PIXELS, MAX_PIXELS_ENV, ImageError, image_key, load_image


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose pixel data is a few bytes of nothing."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


@pytest.fixture
def rgb() -> Image.Image:
    """A 40x20 image whose left half is red and right half blue: orientation is visible in pixels."""
    array = np.zeros((20, 40, 3), np.uint8)
    array[:, :20] = (255, 0, 0)
    array[:, 20:] = (0, 0, 255)
    return Image.fromarray(array)


def pixels(image: Image.Image) -> np.ndarray:
    assert image.mode == "RGB"
    return np.asarray(image)


# accepted inputs


def test_pil_image_gives_new_equal_rgb_image(rgb):
    before = pixels(rgb).copy()
    out = load_image(rgb)
    assert out is not rgb
    assert np.array_equal(pixels(out), before)
    out.putpixel((0, 0), (1, 2, 3))
    assert np.array_equal(pixels(rgb), before), "the caller's image must never change"


def test_path_str_and_pathlib(tmp_path, rgb):
    file = tmp_path / "scene.png"
    rgb.save(file)
    for source in (str(file), file):
        assert np.array_equal(pixels(load_image(source)), pixels(rgb))


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_encoded_bytes(rgb, wrap):
    assert np.array_equal(pixels(load_image(wrap(encode(rgb)))), pixels(rgb))


def test_jpeg_bytes_decode_close_to_original(rgb):
    out = pixels(load_image(encode(rgb, "JPEG", quality=95))).astype(int)
    assert out.shape == (20, 40, 3)
    assert np.abs(out - pixels(rgb).astype(int)).mean() < 8


def test_numpy_rgb_grayscale_rgba():
    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    assert np.array_equal(pixels(load_image(rgb)), rgb)
    gray = rgb[:, :, 0].copy()
    assert np.array_equal(pixels(load_image(gray)), np.repeat(gray[:, :, None], 3, axis=2))
    rgba = np.concatenate([rgb, np.full((5, 7, 1), 255, np.uint8)], axis=2)
    assert np.array_equal(pixels(load_image(rgba)), rgb)


def test_numpy_array_is_copied_not_shared():
    array = np.zeros((4, 4, 3), np.uint8)
    out = load_image(array)
    array[:] = 200
    assert pixels(out).max() == 0


def test_numpy_non_contiguous_view():
    array = np.random.default_rng(1).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    view = array[::2, ::-1]
    assert np.array_equal(pixels(load_image(view)), view)


def test_transparency_is_composited_onto_white():
    rgba = np.zeros((2, 2, 4), np.uint8)  # fully transparent black
    rgba[0, 0] = (10, 20, 30, 255)  # one opaque pixel
    out = pixels(load_image(rgba))
    assert tuple(out[0, 0]) == (10, 20, 30)
    assert tuple(out[1, 1]) == (255, 255, 255)
    assert tuple(pixels(load_image(Image.fromarray(rgba).convert("LA")))[1, 1]) == (255, 255, 255)


def test_palette_with_transparency_and_gif_first_frame():
    frames = [Image.new("P", (6, 4), i) for i in (1, 2)]
    for frame in frames:
        frame.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0] + [0] * 759)
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], transparency=0)
    assert tuple(pixels(load_image(buffer.getvalue()))[0, 0]) == (255, 0, 0)


@pytest.mark.parametrize("mode", ["1", "L", "P", "CMYK", "YCbCr", "HSV"])
def test_other_modes_convert_to_rgb(mode, rgb):
    source = rgb.convert(mode)
    out = load_image(source)
    assert out.size == rgb.size and out.mode == "RGB"


def test_16_bit_grayscale_keeps_its_range():
    ramp = np.linspace(0, 65535, 64, dtype=np.uint16).reshape(8, 8)
    out = pixels(load_image(encode(Image.fromarray(ramp))))
    assert out[..., 0].min() == 0 and out[..., 0].max() == 255
    assert np.array_equal(out[..., 0], (ramp >> 8).astype(np.uint8))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_exif_orientation_is_applied(rgb, fmt):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: a viewer rotates 90 degrees clockwise
    out = pixels(load_image(encode(rgb, fmt, exif=exif)))
    assert out.shape == (40, 20, 3)
    top, bottom = out[2, 10].astype(int), out[-3, 10].astype(int)
    assert top[0] > 200 and top[2] < 60, "the red left half must end on top"
    assert bottom[2] > 200 and bottom[0] < 60


def test_exif_orientation_applied_to_opened_pil_image(rgb, tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 8
    file = tmp_path / "sideways.png"
    rgb.save(file, exif=exif)
    with Image.open(file) as opened:
        assert load_image(opened).size == (20, 40)


# the decompression-bomb guard


def test_guard_refuses_from_header_before_decoding():
    # The pixel data is not there: had it been decoded, the error would say "corrupt", not the limit.
    with pytest.raises(ImageError, match=r"8000x8000 .* over the limit .*max_pixels=N.*" + MAX_PIXELS_ENV):
        load_image(png_header_only(8000, 8000))
    assert DEFAULT_MAX_PIXELS < 8000 * 8000


def test_guard_applies_to_files(tmp_path):
    file = tmp_path / "bomb.png"
    file.write_bytes(png_header_only(8000, 8000))
    with pytest.raises(ImageError, match=r"bomb\.png.* over the limit"):
        load_image(file)


def test_guard_fires_before_pil_would_error():
    with pytest.warns(Image.DecompressionBombWarning), pytest.raises(ImageError, match="over the limit"):
        load_image(png_header_only(10_000, 10_000))


def test_pil_error_for_giant_headers_becomes_image_error():
    with pytest.raises(ImageError, match="decompression-bomb guard"):
        load_image(png_header_only(30_000, 30_000), max_pixels=10**10)


def test_limit_is_configurable_by_argument(rgb):
    data = encode(rgb)
    assert load_image(data, max_pixels=800).size == (40, 20)
    with pytest.raises(ImageError, match="800 pixels, over the limit of 799"):
        load_image(data, max_pixels=799)


def test_limit_is_configurable_by_environment(rgb, monkeypatch):
    monkeypatch.setenv(MAX_PIXELS_ENV, "799")
    for source in (encode(rgb), rgb, np.asarray(rgb)):
        with pytest.raises(ImageError, match="over the limit of 799"):
            load_image(source)
    assert load_image(rgb, max_pixels=800).size == (40, 20), "the argument overrides the environment"
    monkeypatch.setenv(MAX_PIXELS_ENV, "lots")
    with pytest.raises(ImageError, match=MAX_PIXELS_ENV):
        load_image(rgb)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "100"])
def test_bad_limit_is_refused(bad, rgb):
    with pytest.raises(ImageError, match="max_pixels must be a positive int"):
        load_image(rgb, max_pixels=bad)


# refused inputs


@pytest.mark.parametrize("bad", [None, 42, 3.5, ["a.png"], {"image": b""}, object()])
def test_wrong_types(bad):
    with pytest.raises(ImageError, match="pass a PIL image, a path"):
        load_image(bad)


def test_image_error_is_a_value_error():
    assert issubclass(ImageError, ValueError)


@pytest.mark.parametrize(
    ("array", "why"),
    [
        (np.zeros((4, 4, 3), np.float32), "float32"),
        (np.zeros((4, 4, 3), np.uint16), "uint16"),
        (np.zeros((4, 4), bool), "bool"),
        (np.zeros((4, 4, 2), np.uint8), r"\(4, 4, 2\)"),
        (np.zeros((4, 4, 1), np.uint8), r"\(4, 4, 1\)"),
        (np.zeros((2, 4, 4, 3), np.uint8), r"\(2, 4, 4, 3\)"),
        (np.zeros(12, np.uint8), r"\(12,\)"),
    ],
)
def test_unsupported_arrays(array, why):
    with pytest.raises(ImageError, match=why + ".*uint8 array of shape HxW, HxWx3 or HxWx4"):
        load_image(array)


def test_empty_inputs(tmp_path):
    with pytest.raises(ImageError, match="empty"):
        load_image(b"")
    with pytest.raises(ImageError, match="empty"):
        load_image(np.zeros((0, 5, 3), np.uint8))
    with pytest.raises(ImageError, match="empty"):
        load_image(Image.new("RGB", (0, 3)))
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(ImageError, match="empty"):
        load_image(tmp_path / "empty.png")


def test_missing_file_directory_and_url(tmp_path):
    with pytest.raises(ImageError, match="not found"):
        load_image(tmp_path / "nope.png")
    with pytest.raises(ImageError, match="not a file"):
        load_image(str(tmp_path))
    with pytest.raises(ImageError, match="URLs are not fetched"):
        load_image("https://example.com/cat.jpg")


def test_not_an_image(tmp_path):
    with pytest.raises(ImageError, match="not a readable image"):
        load_image(b"hello, this is text")
    (tmp_path / "notes.png").write_text("not a png")
    with pytest.raises(ImageError, match=r"notes\.png.*not a readable image"):
        load_image(tmp_path / "notes.png")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_files(rgb, fmt):
    data = encode(rgb, fmt)
    with pytest.raises(ImageError, match="corrupt"):
        load_image(data[: len(data) // 2])


@pytest.mark.filterwarnings("ignore:Tag data larger than file")  # PIL's TIFF reader notes damage, then fails
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP"])
def test_damaged_bytes_give_an_image_or_image_error(rgb, fmt):
    """Random byte damage anywhere: the only failure allowed is ImageError."""
    data = encode(rgb, fmt)
    rng = random.Random(fmt)
    for _ in range(60):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        cut = damaged[: rng.randint(len(damaged) // 2, len(damaged))]
        for candidate in (damaged, cut):
            try:
                out = load_image(bytes(candidate), max_pixels=10**6)
            except ImageError:
                continue
            assert out.mode == "RGB"


def test_lazily_opened_truncated_pil_image(rgb, tmp_path):
    data = encode(rgb)
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with Image.open(tmp_path / "cut.png") as opened, pytest.raises(ImageError, match="PIL image is corrupt"):
        load_image(opened)


def test_32_bit_modes_are_refused():
    for mode in ("I", "F"):
        with pytest.raises(ImageError, match="32-bit"):
            load_image(Image.new(mode, (3, 3)))


# image_key


def test_image_key_depends_on_pixels_only(rgb, tmp_path):
    rgb.save(tmp_path / "a.png")
    keys = {
        image_key(load_image(source)) for source in (rgb, encode(rgb), tmp_path / "a.png", np.asarray(rgb))
    }
    assert len(keys) == 1
    (key,) = keys
    assert len(key) == 32 and int(key, 16) >= 0


def test_image_key_changes_with_one_pixel_size_or_mode(rgb):
    changed = rgb.copy()
    changed.putpixel((39, 19), (0, 0, 254))
    flat = np.zeros((2, 6, 3), np.uint8)
    keys = [
        image_key(rgb),
        image_key(changed),
        image_key(load_image(flat)),
        image_key(load_image(flat.reshape(6, 2, 3))),  # same bytes, other size
        image_key(Image.new("RGB", (3, 3))),
        image_key(Image.new("HSV", (3, 3))),  # same size, same bytes, other mode
    ]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("mode", ["RGB", "L", "1", "RGBA"])
def test_image_key_is_the_digest_of_the_whole_pixel_bytes(mode):
    """Hashed strip by strip, the key stays the digest of size, mode and all of `tobytes()`."""
    array = np.random.default_rng(2).integers(0, 256, (1500, 1203, 3), dtype=np.uint8)
    image = Image.fromarray(array).convert(mode)  # 1203 wide: several strips, odd row lengths
    whole = hashlib.blake2b(digest_size=16)
    whole.update(f"{mode}:1203x1500:".encode())
    whole.update(image.tobytes())
    assert image_key(image) == whole.hexdigest()


def test_image_key_does_not_copy_every_pixel():
    """The pixel bytes are hashed a strip at a time: never a full `tobytes()` copy (27 MB here)."""
    image = Image.new("RGB", (3000, 3000), (1, 2, 3))
    tracemalloc.start()
    try:
        image_key(image)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"image_key held {peak / 2**20:.0f} MB of bytes at once"


def test_image_key_refuses_non_images():
    with pytest.raises(ImageError, match="load_image first"):
        image_key(Path("a.png"))
