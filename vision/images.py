"""Image input: turn whatever a caller passes as `image` into one RGB PIL image, or refuse it clearly.

PROBLEM
    Skills accept a PIL image, a path, encoded bytes or a numpy array. Each arrives with its own traps:
    phone photos stored sideways with an EXIF orientation tag, palette/alpha/16-bit modes, files that
    are not images or are truncated, and decompression bombs (a few KB of PNG that claim 100k x 100k
    pixels and would take gigabytes to decode). Errors surfacing later, from deep inside a model's
    image processor or PIL, do not tell the user what to fix. And a model's processor usually shrinks
    the image to a few hundred pixels: a 777 KB near-uniform 7000x7000 JPEG decoded in full holds
    ~200 MB (PIL keeps 4 bytes per RGB pixel), twice that while converting, only to be thrown away.

SOLUTION
    `open_image` dispatches on the input type, opens encoded input lazily (PIL reads only the header)
    and checks the pixel count against `max_pixels` before any pixel is decoded; `decode()` then
    decodes, applies the EXIF orientation and converts to RGB (transparency composited onto white,
    16-bit scaled to 8-bit). `load_image` is the two in one call. Every failure is an `ImageError`
    (a ValueError) whose message says what is accepted or what to do.

    With `min_size=(width, height)`, the size the model's processor resizes to, the decode is reduced
    by an integer factor first, keeping each side at least `REDUCE_GAP` times the target: a JPEG by
    DCT scaling (`draft`: the decoder itself outputs 1/2, 1/4 or 1/8 of the size, never holding the
    full image), then any format by `Image.reduce` (box averaging), then one resample onto the exact
    extent (an integer reduction's last row and column cover a partial block; left as they are, the
    processor's resize would shift the content by up to a reduced pixel). The processor's own filter
    still does the last >= `REDUCE_GAP`x of shrinking, so what it outputs from the reduced decode is
    what it outputs from the full one, to within a grey level or two (tests/vision/test_reduce.py
    states the tolerance). `OpenedImage.decode_pixels` is the most pixels the decode holds at once,
    known before decoding: the count a caller reserves from a `PixelBudget` (budget.py).

    `image_key` hashes size, mode and pixels of the *decoded* image into a stable key for the SDK's
    image-encoding cache. With a reduced decode it keys what the processor actually receives: the
    same input at the same `min_size` decodes to the same pixels (same key); a different target or an
    unreduced decode differs in size (different key); two inputs whose reduced decodes are identical
    are identical to the processor, so sharing their cached encoding is correct, not a collision.

INVARIANTS
    1. The result is a new RGB image; the caller's image or array is never modified or returned.
    2. Encoded input over `max_pixels` is refused from its header, before decoding.
    3. Every unreadable, empty, missing, oversized or wrongly typed input raises `ImageError`.
    4. `image_key` depends only on the pixels, size and mode: equal images give equal keys.
    5. With `min_size`, each side of the result (as displayed, after EXIF orientation) is at least
       `REDUCE_GAP` times the target's, or the source's own side when that is smaller: the decode
       never goes below what the processor needs.
    6. A decode holds at most `decode_pixels` pixels of image at once (plus a same-size RGB copy while
       converting): the reduced size for a baseline JPEG, the source's size otherwise.

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
from typing import Any, cast

import numpy as np
from PIL import ExifTags, Image, UnidentifiedImageError

DEFAULT_MAX_PIXELS = 50_000_000  # 8K x 6K; below PIL's own warning threshold (~89.5M) so ours fires first
MAX_PIXELS_ENV = "FOVEAL_MAX_IMAGE_PIXELS"
# A reduced decode keeps this many times the processor's target per side, so that the processor's
# resampling filter, not our box averaging, shapes what the model sees (Pillow's `reducing_gap` idea).
REDUCE_GAP = 3

ACCEPTED = (
    "a PIL image, a path (str or pathlib.Path), encoded bytes (PNG, JPEG, ...), "
    "or a numpy uint8 array of shape HxW (grayscale), HxWx3 (RGB) or HxWx4 (RGBA)"
)

# What PIL raises for malformed files varies by format plugin; all of them mean "corrupt input".
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)
# Modes that `reduce` and `resize` average correctly (alpha premultiplied by PIL); others (palette
# indices, CMYK, 16-bit) are converted to RGB before they are reduced.
_REDUCIBLE = frozenset({"L", "RGB", "RGBA", "LA"})
# EXIF orientation -> the transpose that shows the image upright (the table of ImageOps.exif_transpose,
# applied here to the already reduced image, whose EXIF data PIL does not always carry over).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SIDEWAYS = frozenset({5, 6, 7, 8})  # orientations that swap width and height
_KEY_STRIP_BYTES = 4 * 2**20


class ImageError(ValueError):
    """The image cannot be used: wrong type, missing file, corrupt data, or too many pixels."""


class OpenedImage:
    """An input whose header has been read and checked, not yet decoded (made by `open_image`).

    `decode_pixels`: the most pixels `decode()` holds at once (the reduced size for a baseline JPEG
    decoded by DCT scaling, the source's size otherwise), known before any pixel is decoded.
    `decode()` may be called once; `close()` (or leaving a `with` block) closes a file it opened.
    """

    __slots__ = (
        "_array",
        "_image",
        "_limit",
        "_owned",
        "_scale",
        "_size",
        "_source",
        "_target",
        "decode_pixels",
    )

    def __init__(
        self,
        source: str,
        limit: int,
        target: tuple[int, int] | None,
        *,
        image: Image.Image | None = None,
        array: np.ndarray | None = None,
        size: tuple[int, int] | None = None,
        owned: bool = False,
        scale: int = 1,
    ) -> None:
        self._source = source
        self._limit = limit
        self._target = target
        self._image = image
        self._array = array
        self._owned = owned  # opened here from bytes or a path: ours to decode in place and to close
        self._scale = scale  # the JPEG decoder's own reduction (draft), 1 when none
        # The source's stored size (before any draft, before EXIF orientation).
        self._size = size or (image.size if image is not None else (cast(np.ndarray, array).shape[1], cast(np.ndarray, array).shape[0]))
        if scale > 1 and image is not None and not image.info.get("progressive"):  # (scale > 1: a JPEG's draft)
            self.decode_pixels = image.width * image.height  # what the DCT-scaled decoder outputs
        else:  # a progressive JPEG's decoder buffers the coefficients of the whole image at any scale
            self.decode_pixels = self._size[0] * self._size[1]

    def decode(self) -> Image.Image:
        """The RGB image, upright, reduced when a target was given; `ImageError` if it cannot be read."""
        if self._image is None and self._array is None:
            raise ImageError(f"{self._source} was already decoded or closed; open it again with open_image")
        image, self._image, array, self._array = self._image, None, self._array, None
        try:
            if array is not None:
                # fromarray infers L/RGB/RGBA from the shape and may share memory; _normalize makes a new one.
                image = Image.fromarray(np.ascontiguousarray(array))
            elif self._owned:
                try:
                    cast(Image.Image, image).load()  # owned: opened here, an image
                except _DECODE_ERRORS as error:
                    raise ImageError(f"{self._source} is corrupt or truncated: {error}") from error
            return _normalize(cast(Image.Image, image), self._limit, self._source, self._target, self._scale, self._size)
        finally:
            if self._owned:
                cast(Image.Image, image).close()

    def close(self) -> None:
        if self._owned and self._image is not None:
            self._image.close()
        self._image = self._array = None

    def __enter__(self) -> OpenedImage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_image(
    image: Any, *, max_pixels: int | None = None, min_size: tuple[int, int] | None = None
) -> Image.Image:
    """Return `image` as a new RGB PIL image with its EXIF orientation applied.

    `image` is a PIL image, a path (str or Path), encoded bytes, or a numpy uint8 array (HxW, HxWx3,
    HxWx4). Images with more than `max_pixels` pixels are refused (default: `FOVEAL_MAX_IMAGE_PIXELS`
    from the environment, else `DEFAULT_MAX_PIXELS`); encoded input is checked from its header,
    before decoding. `min_size=(width, height)`: the size the model's image processor resizes to;
    the image is then decoded reduced, each side kept at least `REDUCE_GAP` times the target's (see
    the module docstring). Raises `ImageError` for anything unusable.
    """
    with open_image(image, max_pixels=max_pixels, min_size=min_size) as opened:
        return opened.decode()


def open_image(
    image: Any, *, max_pixels: int | None = None, min_size: tuple[int, int] | None = None
) -> OpenedImage:
    """`load_image` in two steps: read and check the header now, `decode()` later (arguments alike).

    Between the two, `OpenedImage.decode_pixels` says how many pixels the decode will hold, so a
    caller can reserve them (`PixelBudget.acquire`) before any is decoded.
    """
    limit = _pixel_limit(max_pixels)
    target = _target(min_size)
    if isinstance(image, Image.Image):
        _check_pixels(image.width, image.height, limit, "PIL image")
        return OpenedImage("PIL image", limit, target, image=image)
    if isinstance(image, np.ndarray):
        _check_array(image, limit)
        return OpenedImage("numpy image", limit, target, array=image)
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        if not data:
            raise ImageError("image bytes are empty (0 bytes)")
        return _open(io.BytesIO(data), "image bytes", limit, target)
    if isinstance(image, (str, os.PathLike)):
        file, source = _checked_path(image)
        return _open(file, source, limit, target)
    raise ImageError(f"cannot use an image of type {type(image).__name__}; pass {ACCEPTED}")


def image_key(image: Image.Image) -> str:
    """A stable hex key of an image's size, mode and pixels (for caching per-image encodings).

    Take it from `load_image`'s result (reduced or not): it then names exactly what the processor gets.
    """
    if not isinstance(image, Image.Image):
        raise ImageError(f"image_key takes a PIL image (use load_image first), not {type(image).__name__}")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    # Hashed in strips of rows: the digest of the whole `tobytes()`, without its copy of every pixel
    # (150 MB for a 7000x7000 RGB image) beside the image itself.
    rows = max(1, _KEY_STRIP_BYTES // (4 * image.width))
    for top in range(0, image.height, rows):
        digest.update(image.crop((0, top, image.width, min(image.height, top + rows))).tobytes())
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


def _target(min_size: Any) -> tuple[int, int] | None:
    if min_size is None:
        return None
    valid = (
        isinstance(min_size, (tuple, list))
        and len(min_size) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in min_size)
    )
    if not valid:
        raise ImageError(
            f"min_size must be (width, height) in positive ints, the size the model's processor resizes "
            f"to, or None for a full decode; got {min_size!r}"
        )
    return int(min_size[0]), int(min_size[1])


def _check_pixels(width: int, height: int, limit: int, source: str) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"{source} is empty ({width}x{height} pixels)")
    if width * height > limit:
        raise ImageError(
            f"{source} is {width}x{height} = {width * height:,} pixels, over the limit of {limit:,} "
            f"(a guard against decompression bombs); downscale the image, or raise the limit with "
            f"load_image(..., max_pixels=N) or the environment variable {MAX_PIXELS_ENV}=N"
        )


def _check_array(array: np.ndarray, limit: int) -> None:
    shape_ok = array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))
    if array.dtype != np.uint8 or not shape_ok:
        raise ImageError(
            f"cannot use a numpy array of dtype {array.dtype} and shape {array.shape}; pass a uint8 array of "
            "shape HxW, HxWx3 or HxWx4 (for floats in [0, 1]: (a * 255).round().astype(np.uint8))"
        )
    height, width = array.shape[:2]
    _check_pixels(width, height, limit, "numpy image")


def _checked_path(path: str | os.PathLike) -> tuple[Path, str]:
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
    return file, source


def _open(file: Path | io.BytesIO, source: str, limit: int, target: tuple[int, int] | None) -> OpenedImage:
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
    try:
        _check_pixels(opened.width, opened.height, limit, source)
        size = opened.size  # before draft, which changes it
        scale = _draft(opened, target, source)
        return OpenedImage(source, limit, target, image=opened, size=size, owned=True, scale=scale)
    except BaseException:
        opened.close()
        raise


def _draft(opened: Image.Image, target: tuple[int, int] | None, source: str) -> int:
    """Have a JPEG decoder output 1/2, 1/4 or 1/8 of the size where the target allows; the scale set."""
    if target is None or opened.format not in ("JPEG", "MPO"):
        return 1  # other formats decode in full (and reading their EXIF before decoding may decode: PNG)
    width = opened.width
    try:
        drafted = opened.draft(None, _need(target, _orientation(opened)))
    except _DECODE_ERRORS as error:
        raise ImageError(f"{source} is corrupt: {error}") from error
    if drafted is None:  # a layout the decoder cannot scale
        return 1
    _, (_, _, scaled_width, _) = drafted
    return round(width / scaled_width)


def _orientation(image: Image.Image) -> int:
    orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    return orientation if orientation in _UPRIGHT else 1


def _need(target: tuple[int, int], orientation: int) -> tuple[int, int]:
    """The smallest stored size (before orientation) that keeps REDUCE_GAP x `target` upright."""
    width, height = target[0] * REDUCE_GAP, target[1] * REDUCE_GAP
    return (height, width) if orientation in _SIDEWAYS else (width, height)


def _normalize(
    image: Image.Image,
    limit: int,
    source: str,
    target: tuple[int, int] | None = None,
    scale: int = 1,
    size: tuple[int, int] | None = None,
) -> Image.Image:
    """The decoded `image` (`scale`: reduced by its JPEG decoder from the stored `size`) as upright RGB."""
    _check_pixels(image.width, image.height, limit, source)
    try:
        orientation = _orientation(image)
        if target is not None:
            image = _reduce(image, _need(target, orientation), scale, size or image.size, source)
        if orientation in _UPRIGHT:
            image = image.transpose(_UPRIGHT[orientation])
        return _to_rgb(image, source)  # decodes a lazily opened PIL image the caller passed
    except ImageError:
        raise
    except _DECODE_ERRORS as error:
        raise ImageError(f"{source} is corrupt or truncated: {error}") from error


def _reduce(
    image: Image.Image, need: tuple[int, int], scale: int, size: tuple[int, int], source: str
) -> Image.Image:
    """`image`, the source of stored `size` already reduced `scale` times, reduced by the largest total
    integer factor that keeps `need`, then resampled onto the exact extent of the source."""
    width, height = size
    # A multiple of the decoder's scale (which the same `need` bounded), so the two compose exactly.
    factor = max(scale, min(width // need[0], height // need[1]) // scale * scale)
    if factor <= 1:
        return image
    if image.mode not in _REDUCIBLE:
        image = _to_rgb(image, source)
    if factor > scale:
        image = image.reduce(factor // scale)
    if width % factor or height % factor:
        # The last column and row stand for a partial block; resampling the box of the true extent
        # keeps the content where the full image has it (within a fraction of a reduced pixel).
        box = (0.0, 0.0, width / factor, height / factor)
        image = image.resize((width // factor, height // factor), Image.Resampling.BICUBIC, box=box)
    return image


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
