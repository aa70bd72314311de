"""Images in requests: base64 data URLs to bytes. Decoding (and its checks) is the SDK's `load_image`.

Both APIs send an image as a URL string. Only `data:` URLs are accepted: the server never fetches a
URL on a client's behalf (that would let any client make the server reach hosts on its network).
The bytes go to the `Model` as they are; it decodes them and refuses unreadable images and
decompression bombs with `ImageError`. The body limit (gate.py) bounds the encoded size.

PROBLEM
    A data URL may be as large as the body limit (16 MB). Parsing it with one regular expression
    over the whole URL, on the event loop, let `data:;;;;...` (16 MB of parameters) backtrack for
    seconds and grow the process by gigabytes while every other request, /health included, waited;
    decoding 16 MB of base64 in one call holds the loop (and the GIL) for tens of milliseconds.
SOLUTION
    The header (`data:[mime][;params];base64,`) is found by a bounded search for its comma, within
    MAX_HEADER_CHARS, and parsed on its own; no pattern ever runs over the payload. The payload is
    decoded by `image_bytes` in slices of DECODE_SLICE_CHARS, so a worker thread (`decode_image`,
    what the routes await) hands the GIL back to the loop between slices.
INVARIANTS
    - Work before a refusal is bounded by MAX_HEADER_CHARS, whatever the URL's length.
    - No call made on the event loop touches a payload longer than a header.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re

from foveal.server.errors import ApiError

MAX_HEADER_CHARS = 256  # "data:" + a mime type and its parameters + ";base64,"
DECODE_SLICE_CHARS = 1 << 20  # a multiple of 4: each slice decodes alone, in about a millisecond
_MIME = re.compile(r"[\w.+-]+/[\w.+-]+")


async def decode_image(url: str | None, param: str = "image_url") -> bytes | None:
    """`image_bytes` in a worker thread: a 16 MB payload never holds the event loop."""
    if url is None:
        return None
    if len(url) <= MAX_HEADER_CHARS:  # nothing to gain from a thread
        return image_bytes(url, param)
    return await asyncio.to_thread(image_bytes, url, param)


def image_bytes(url: str | None, param: str = "image_url") -> bytes | None:
    """The encoded image of a data URL (None for None); ApiError 400 for anything else."""
    if url is None:
        return None
    start = len(url) - len(url.lstrip()) if url[:1].isspace() else 0
    head = url[start : start + 16].lower()
    if head.startswith(("http://", "https://")):
        raise _invalid(
            param,
            "remote URLs are not fetched by this server; send the image inline as a base64 data URL, "
            "e.g. data:image/jpeg;base64,...",
        )
    comma = url.find(",", start, start + MAX_HEADER_CHARS)
    if not url.startswith("data:", start) or comma < 0 or not _header_ok(url[start + 5 : comma]):
        raise _invalid(
            param,
            f"expected a base64 data URL such as data:image/png;base64,iVBORw0...; got "
            f"{url[start:start + 40]!r}{'...' if len(url) - start > 40 else ''}",
        )
    data = _decode(url, comma + 1, param)
    if not data:
        raise _invalid(param, "the data URL holds no bytes")
    return data


def _header_ok(header: str) -> bool:
    """Whether `[mime][;param...];base64` (the part between "data:" and the comma) is well formed."""
    *rest, last = header.split(";")
    if last != "base64" or not rest:
        return False
    mime, params = rest[0], rest[1:]
    return (not mime or _MIME.fullmatch(mime) is not None) and all("," not in p for p in params)


def _decode(url: str, start: int, param: str) -> bytes:
    """The payload's bytes, decoded slice by slice (whitespace, as in wrapped base64, dropped)."""
    payload = url[start:]
    # str.split drops whitespace in one pass in C; slice by slice, so that the GIL is handed back
    payload = "".join(
        "".join(payload[i : i + DECODE_SLICE_CHARS].split()) for i in range(0, len(payload), DECODE_SLICE_CHARS)
    )
    # Each slice decodes alone only if padding ends the whole payload (as one decode requires)
    if len(payload) % 4 or payload.find("=", 0, len(payload) - 2) >= 0:
        raise _invalid(param, "the data URL's base64 payload is invalid")
    pieces = []
    try:
        for i in range(0, len(payload), DECODE_SLICE_CHARS):
            pieces.append(base64.b64decode(payload[i : i + DECODE_SLICE_CHARS], validate=True))
    except (binascii.Error, ValueError):
        raise _invalid(param, "the data URL's base64 payload is invalid") from None
    return b"".join(pieces)


def _invalid(param: str, detail: str) -> ApiError:
    return ApiError(400, f"{param}: {detail}", "invalid_image", param)
