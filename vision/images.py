"""Image input: turn whatever a caller passes as `image` into one RGB PIL image, or refuse it clearly.

PROBLEM
    Skills accept a PIL image, a path, encoded bytes or a numpy array. Each arrives with its own traps:
    phone photos stored sideways with an EXIF orientation tag, palette/alpha/16-bit modes, files that
    are not images or are truncated, and decompression bombs (a few KB of PNG that claim 100k x 100k
    pixels and would take gigabytes to decode). Errors surfacing later, from deep inside a model's
    image processor or PIL, do not tell the user what to fix.

SOLUTION
    `load_image` dispatches on the input type, opens encoded input lazily (PIL reads only the header),
    checks the pixel count against `max_pixels` before any pixel is decoded, then decodes, applies the
    EXIF orientation and converts to RGB (transparency composited onto white, 16-bit scaled to 8-bit).
    Every failure is an `ImageError` (a ValueError) whose message says what is accepted or what to do.
    `image_key` hashes size, mode and pixels into a stable key for the SDK's image-encoding cache.

INVARIANTS
    1. The result is a new RGB image; the caller's image or array is never modified or returned.
    2. Encoded input over `max_pixels` is refused from its header, before decoding.
    3. Every unreadable, empty, missing, oversized or wrongly typed input raises `ImageError`.
    4. `image_key` depends only on the pixels, size and mode: equal images give equal keys.

The limit defaults to `DEFAULT_MAX_PIXELS`, or to the environment variable `FOVEAL_MAX_IMAGE_PIXELS`
when it is set (read at each call, so it reaches loads made deep inside the SDK). PIL keeps its own,
higher guard (`PIL.Image.MAX_IMAGE_PIXELS`: a warning above it, an error above twice it); raising the
foveal limit past PIL's error threshold also requires raising PIL's.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 50_000_000  # 8K x 6K; below PIL's own warning threshold (~89.5M) so ours fires first
MAX_PIXELS_ENV = "FOVEAL_MAX_IMAGE_PIXELS"

ACCEPTED = (
    "a PIL image, a path (str or pathlib.Path), encoded bytes (PNG, JPEG, ...), "
    "or a numpy uint8 array of shape HxW (grayscale), HxWx3 (RGB) or HxWx4 (RGBA)"
)

# What PIL raises for malformed files varies by format plugin; all of them mean "corrupt input".
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)


class ImageError(ValueError):
    """The image cannot be used: wrong type, missing file, corrupt data, or too many pixels."""


def load_image(image: Any, *, max_pixels: int | None = None) -> Image.Image:
    """Return `image` as a new RGB PIL image with its EXIF orientation applied.

    `image` is a PIL image, a path (str or Path), encoded bytes, or a numpy uint8 array (HxW, HxWx3,
    HxWx4). Images with more than `max_pixels` pixels are refused (default: `FOVEAL_MAX_IMAGE_PIXELS`
    from the environment, else `DEFAULT_MAX_PIXELS`); encoded input is checked from its header,
    before decoding. Raises `ImageError` for anything unusable.
    """
    limit = _pixel_limit(max_pixels)
    if isinstance(image, Image.Image):
        return _normalize(image, limit, source="PIL image")
    if isinstance(image, np.ndarray):
        return _from_array(image, limit)
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _from_bytes(bytes(image), limit)
    if isinstance(image, (str, os.PathLike)):
        return _from_path(image, limit)
    raise ImageError(f"cannot use an image of type {type(image).__name__}; pass {ACCEPTED}")


def image_key(image: Image.Image) -> str:
    """A stable hex key of an image's size, mode and pixels (for caching per-image encodings)."""
    if not isinstance(image, Image.Image):
        raise ImageError(f"image_key takes a PIL image (use load_image first), not {type(image).__name__}")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _pixel_limit(max_pixels: int | None) -> int:
    if max_pixels is None:
        text = os.environ.get(MAX_PIXELS_ENV)
        if text is None:
            return DEFAULT_MAX_PIXELS
        try:
            max_pixels = int(text)
        except ValueError:
            raise ImageError(
                f"{MAX_PIXELS_ENV}={text!r} is not an integer; set it to a pixel count"
            ) from None
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ImageError(f"max_pixels must be a positive int, got {max_pixels!r}")
    return max_pixels


def _check_pixels(width: int, height: int, limit: int, source: str) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"{source} is empty ({width}x{height} pixels)")
    if width * height > limit:
        raise ImageError(
            f"{source} is {width}x{height} = {width * height:,} pixels, over the limit of {limit:,} "
            f"(a guard against decompression bombs); downscale the image, or raise the limit with "
            f"load_image(..., max_pixels=N) or the environment variable {MAX_PIXELS_ENV}=N"
        )


def _from_path(path: str | os.PathLike, limit: int) -> Image.Image:
    text = os.fspath(path)
    if isinstance(text, str) and text.startswith(("http://", "https://")):
        raise ImageError(f"URLs are not fetched ({text!r}); download the image and pass its path or bytes")
    file = Path(text)
    if not file.exists():
        raise ImageError(f"image file not found: {str(file)!r}")
    if not file.is_file():
        raise ImageError(f"not a file: {str(file)!r}; pass the path of an image file")
    source = f"image file {str(file)!r}"
    if file.stat().st_size == 0:
        raise ImageError(f"{source} is empty (0 bytes)")
    return _decode(file, limit, source)


def _from_bytes(data: bytes, limit: int) -> Image.Image:
    if not data:
        raise ImageError("image bytes are empty (0 bytes)")
    return _decode(io.BytesIO(data), limit, "image bytes")


def _decode(file: Path | io.BytesIO, limit: int, source: str) -> Image.Image:
    try:
        opened = Image.open(file)  # lazy: reads the header only
    except UnidentifiedImageError:
        raise ImageError(
            f"{source} is not a readable image (format not recognized); pass PNG, JPEG, WebP, GIF, BMP or TIFF data"
        ) from None
    except PermissionError as error:
        raise ImageError(f"cannot read {source}: {error}") from error
    except Image.DecompressionBombError as error:
        raise ImageError(
            f"{source} is refused by PIL's own decompression-bomb guard ({error}); downscale the image, "
            f"or raise both PIL.Image.MAX_IMAGE_PIXELS and foveal's limit ({MAX_PIXELS_ENV})"
        ) from None
    except _DECODE_ERRORS as error:
        raise ImageError(f"{source} is corrupt: {error}") from error
    with opened:
        _check_pixels(opened.width, opened.height, limit, source)
        try:
            opened.load()
        except _DECODE_ERRORS as error:
            raise ImageError(f"{source} is corrupt or truncated: {error}") from error
        return _normalize(opened, limit, source)


def _from_array(array: np.ndarray, limit: int) -> Image.Image:
    shape_ok = array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))
    if array.dtype != np.uint8 or not shape_ok:
        raise ImageError(
            f"cannot use a numpy array of dtype {array.dtype} and shape {array.shape}; pass a uint8 array of "
            "shape HxW, HxWx3 or HxWx4 (for floats in [0, 1]: (a * 255).round().astype(np.uint8))"
        )
    height, width = array.shape[:2]
    _check_pixels(width, height, limit, "numpy image")
    # fromarray infers L/RGB/RGBA from the shape and may share memory; _normalize returns a new image.
    return _normalize(Image.fromarray(np.ascontiguousarray(array)), limit, "numpy image")


def _normalize(image: Image.Image, limit: int, source: str) -> Image.Image:
    _check_pixels(image.width, image.height, limit, source)
    try:
        # exif_transpose copies even when there is nothing to do; skip it unless the image is rotated.
        if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            image = ImageOps.exif_transpose(image)
        return _to_rgb(image, source)  # decodes a lazily opened PIL image the caller passed
    except ImageError:
        raise
    except _DECODE_ERRORS as error:
        raise ImageError(f"{source} is corrupt or truncated: {error}") from error


def _to_rgb(image: Image.Image, source: str) -> Image.Image:
    if image.mode.startswith("I;16"):
        # PIL's own conversion clips 16-bit values at 255; keep the high byte instead.
        high = (np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8)
        return Image.fromarray(high).convert("RGB")
    if image.mode in ("I", "F"):
        raise ImageError(f"{source} has 32-bit {image.mode!r} pixels; convert it to 8-bit RGB first")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        # Transparent pixels often hold arbitrary colours; a white backdrop is what a viewer shows.
        rgba = image.convert("RGBA")
        backdrop = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(backdrop, rgba).convert("RGB")
    return image.convert("RGB")
