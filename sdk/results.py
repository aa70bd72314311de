"""Result types: what skills return. Plain dicts to the caller, drawn pictures in Jupyter.

Users treat a result as Moondream's plain dict: `r["objects"]`, `json.dumps(r)`, `r == {...}`,
`isinstance(r, dict)`. In a notebook the same object renders as the image with its boxes and points
drawn. So each result is a dict subclass that keeps the image it answers about as an attribute
(`result.image`, held by reference: not a key, never serialized, ignored by equality). The image is
any input `foveal.vision.load_image` accepts; `image=None` renders as text only.

`DetectResult` and `PointResult` check their coordinates on construction (the same checks `draw`
makes), so a malformed answer fails where it is made, not later in a notebook.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Iterator
from typing import Any

from PIL import Image

from foveal.vision import draw, load_image
from foveal.vision.draw import parse_result

DISPLAY_MAX_SIDE = 768  # notebook previews are downscaled; normalized coordinates make this lossless


class Result(dict):
    """A skill's answer: a plain dict plus `.image`, the image it is about (used only for display)."""

    __slots__ = ("image",)

    def __init__(self, data: Any = (), /, *, image: Any = None, **fields: Any) -> None:
        super().__init__(data, **fields)
        self.image = image

    def annotated(self) -> Image.Image:
        """The image with this result's boxes and points drawn (the image alone when it has neither)."""
        if self.image is None:
            raise ValueError("this result has no image to draw on; use foveal.vision.draw(image, result)")
        if "objects" in self or "points" in self:
            return draw(self.image, self)
        return load_image(self.image)

    def _repr_png_(self) -> bytes | None:
        if self.image is None:
            return None  # Jupyter falls back to the dict's text
        preview = self.annotated()
        preview.thumbnail((DISPLAY_MAX_SIDE, DISPLAY_MAX_SIDE))
        buffer = io.BytesIO()
        preview.save(buffer, "PNG")
        return buffer.getvalue()

    def _repr_html_(self) -> str | None:
        png = self._repr_png_()
        if png is None:
            return None
        source = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        text = html.escape(json.dumps(self, default=repr, indent=1))
        return f'<div><img src="{source}" style="max-width:100%"/><pre>{text}</pre></div>'


class CaptionResult(Result):
    """`{"caption": str}`, or an iterator of text chunks when streamed."""

    __slots__ = ()

    def __init__(self, caption: str | Iterator[str], *, image: Any = None) -> None:
        super().__init__(caption=caption, image=image)


class QueryResult(Result):
    """`{"answer": str}`, or an iterator of text chunks when streamed."""

    __slots__ = ()

    def __init__(self, answer: str | Iterator[str], *, image: Any = None) -> None:
        super().__init__(answer=answer, image=image)


class DetectResult(Result):
    """`{"objects": [{"x_min", "y_min", "x_max", "y_max"}, ...]}`, floats in [0, 1], origin top-left."""

    __slots__ = ()

    def __init__(self, objects: list[dict[str, float]], *, image: Any = None) -> None:
        parse_result({"objects": objects})
        super().__init__(objects=objects, image=image)


class PointResult(Result):
    """`{"points": [{"x", "y"}, ...]}`, floats in [0, 1], origin top-left."""

    __slots__ = ()

    def __init__(self, points: list[dict[str, float]], *, image: Any = None) -> None:
        parse_result({"points": points})
        super().__init__(points=points, image=image)


class GenerateResult(Result):
    """`{"text": raw model text, "output": the parsed value (a pydantic instance for a pydantic class)}`."""

    __slots__ = ()

    def __init__(self, text: str, output: Any = None, *, image: Any = None) -> None:
        super().__init__(text=text, output=output, image=image)
