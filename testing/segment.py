"""A stand-in segment skill on any family's caption prompt, for tests of the segment surface (the
SDK's `segment` / `asegment`, their streams, the server's /v1/segment) without a model that segments.

The answer is the family's own short caption, read as an outline: one point per character (x from
the character, y from its place), the box from the first character. A character never changes once
streamed, so `progress` settles the points of the text so far, whose path is a prefix of the whole
answer's: the stream's chunks join to the final path, as a real family's must.

    with segmenting(model.family):
        model.segment(image, "circle")   # {"path": "M ... L ...", "bbox": {...}}
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from foveal.families.base import Family
from foveal.families.task import Task
from foveal.vision.svg import format_number


def outline(text: str) -> dict[str, Any]:
    """The value of an answer's text so far: its box (None before the first character) and path."""
    path = "M 0.5 0.5" + "".join(
        f" L {format_number((ord(c) % 97) / 96)} {format_number((i % 11) / 10)}" for i, c in enumerate(text)
    )
    if not text:
        return {"path": path, "bbox": None}
    x = (ord(text[0]) % 97) / 96
    return {"path": path, "bbox": {"x_min": x / 2, "y_min": 0.25, "x_max": (1 + x) / 2, "y_max": 0.75}}


@contextlib.contextmanager
def segmenting(family: Family) -> Iterator[Family]:
    """`family` declaring and answering segment (its caption prompt, the answer read by `outline`)
    while the block runs; as it was afterwards."""
    caps = family.capabilities
    family.capabilities = dataclasses.replace(
        caps, skills=caps.skills | {"segment"}, spatial_refs=caps.spatial_refs | {"segment"}
    )

    def segment(phrase: str, refs: tuple[tuple[float, ...], ...] | None) -> Task:
        caption = family.caption("short")
        return dataclasses.replace(caption, skill="segment", parse=outline, progress=outline)

    family.segment = segment  # type: ignore[method-assign]
    try:
        yield family
    finally:
        family.capabilities = caps
        del family.segment
