"""Images in requests: base64 data URLs to bytes. Decoding (and its checks) is the SDK's `load_image`.

Both APIs send an image as a URL string. Only `data:` URLs are accepted: the server never fetches a
URL on a client's behalf (that would let any client make the server reach hosts on its network).
The bytes go to the `Model` as they are; it decodes them and refuses unreadable images and
decompression bombs with `ImageError`. The body limit (gate.py) bounds the encoded size.
"""

from __future__ import annotations

import base64
import binascii
import re

from foveal.server.errors import ApiError

DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.S)


def image_bytes(url: str | None, param: str = "image_url") -> bytes | None:
    """The encoded image of a data URL (None for None); ApiError 400 for anything else."""
    if url is None:
        return None
    head = url[:16].lower()
    if head.startswith(("http://", "https://")):
        raise ApiError(
            400,
            f"{param}: remote URLs are not fetched by this server; send the image inline as a base64 "
            "data URL, e.g. data:image/jpeg;base64,...",
            "invalid_image",
            param,
        )
    found = DATA_URL.fullmatch(url.strip())
    if found is None:
        raise ApiError(
            400,
            f"{param}: expected a base64 data URL such as data:image/png;base64,iVBORw0...; got "
            f"{url[:40]!r}{'...' if len(url) > 40 else ''}",
            "invalid_image",
            param,
        )
    try:
        data = base64.b64decode(re.sub(r"\s+", "", found["data"]), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(
            400, f"{param}: the data URL's base64 payload is invalid", "invalid_image", param
        ) from None
    if not data:
        raise ApiError(400, f"{param}: the data URL holds no bytes", "invalid_image", param)
    return data
