"""Result types: what skills return. Plain dicts to the caller, drawn pictures in Jupyter.

Users treat a result as Moondream's plain dict: `r["objects"]`, `json.dumps(r)`, `r == {...}`,
`isinstance(r, dict)`. In a notebook the same object renders as the image with its boxes and points
drawn. So each result is a dict subclass that keeps the image it answers about as an attribute
(`result.image`, held by reference: not a key, never serialized, ignored by equality). The image is
any input `foveal.vision.load_image` accepts; `image=None` renders as text only.

`DetectResult` and `PointResult` check their coordinates on construction (the same checks `draw`
makes), so a malformed answer fails where it is made, not later in a notebook.

A streamed caption or answer is a `TextStream` (`AsyncTextStream` for the async skills): iterate it
to get text chunks as they are generated. Leaving the loop early (`break`, an exception) or
`close()` stops the generation at once, even while the result dict is still referenced: each loop
gets its own iterator, which is dropped, and so closed, when the loop is left.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from PIL import Image, ImageDraw

from foveal.errors import GenerationError
from foveal.vision import draw, load_image, svg
from foveal.vision.draw import parse_result

DISPLAY_MAX_SIDE = 768  # notebook previews are downscaled; normalized coordinates make this lossless


@dataclass(frozen=True, slots=True)
class Usage:
    """What a call cost: prompt tokens (image placeholders included), generated tokens (without the
    EOS or stop token that ended them), why generation ended ("stop" or "length"), and where its
    time went in the engine, in milliseconds (foveal.engine.Timings): `ttft_ms` from submit to the
    first token (the wait for a batch row included), `prefill_time_ms` from admission to the first
    token, `decode_time_ms` from the first token to the end.

    The times are measurements, different on every run: equality compares what was counted only."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    prefill_time_ms: float = field(default=0.0, compare=False)
    decode_time_ms: float = field(default=0.0, compare=False)
    ttft_ms: float = field(default=0.0, compare=False)

    def then(self, later: Usage) -> Usage:
        """One call made of this request and then `later`, whose prompt holds this one's prompt and
        output (a grounded query: its reasoning, then its answer): this prompt, both outputs, the
        later end, the first token and prefill of this one, and everything after as decoding."""
        return Usage(
            self.prompt_tokens,
            self.completion_tokens + later.completion_tokens,
            later.finish_reason,
            self.prefill_time_ms,
            self.decode_time_ms + later.ttft_ms + later.decode_time_ms,
            self.ttft_ms,
        )


class Result(dict):
    """A skill's answer: a plain dict plus `.image`, the image it is about (used only for display),
    and `.usage` (a `Usage`; None for a streamed answer, whose stream carries it once read)."""

    __slots__ = ("image", "usage")
    SKILL: ClassVar[str] = ""  # the skill that answers with this type

    def __init__(self, data: Any = (), /, *, image: Any = None, **fields: Any) -> None:
        super().__init__(data, **fields)
        self.image = image
        self.usage: Usage | None = None

    @classmethod
    def of_answer(cls, text: str, value: Any, image: Any = None) -> Self:
        """The result of a skill call from the model's text and its parsed value."""
        return cls(value, image=image)

    @classmethod
    def of_updates(
        cls, text: TextStream | AsyncTextStream, progress: Callable[[str], dict], parse: Callable[[str], Any],
        image: Any = None,
    ) -> Any:
        """A streamed answer read as updates of its value (`progress` of the text so far, `parse` of
        the whole): only skills whose stream is not text (segment) have one."""
        raise TypeError(f"{cls.SKILL or 'this skill'} streams its answer as text, not as updates")

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


class TextStream:
    """Text chunks of a streamed answer, as they are generated (`for chunk in stream`, `"".join(stream)`).

    Read it in one loop. Leaving the loop before the end (`break`, an exception) or `close()` stops
    the generation at once and frees its place in the engine; reading on after that raises
    GenerationError. At the end of the text, a failed, cancelled or cut constrained answer raises
    as the non-streamed call would; a complete one sets `.usage`.
    """

    __slots__ = ("_chunks", "_stopped", "usage")

    def __init__(self, chunks: Generator[str, None, Usage | None]) -> None:
        self._chunks = chunks  # a generator that cancels its request when closed, returning the usage
        self._stopped = False
        self.usage: Usage | None = None

    def __iter__(self) -> Iterator[str]:
        self._check_open()
        return self._follow()

    def __next__(self) -> str:
        self._check_open()
        try:
            return next(self._chunks)
        except StopIteration as end:
            self.usage = end.value
            raise

    def close(self) -> None:
        """Stop the generation (a no-op once the text is complete)."""
        self._stopped = True
        self._chunks.close()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _follow(self) -> Iterator[str]:
        # One iterator per loop: a loop left early drops it, CPython closes it at once, and closing
        # it closes the chunks, which cancels the request.
        try:
            self.usage = yield from self._chunks
        except GeneratorExit:
            self._stopped = True
            raise

    def _check_open(self) -> None:
        if self._stopped:
            raise GenerationError("this stream was stopped before its end (a loop left early, or close())")


class AsyncTextStream:
    """`TextStream` for the async skills: `async for chunk in stream`; leaving the loop or
    `await stream.aclose()` stops the generation; a complete answer sets `.usage`."""

    __slots__ = ("_chunks", "_stopped", "usage")

    def __init__(self, chunks: AsyncIterator[str | Usage]) -> None:
        # An async generator that cancels its request when closed; its last item is the Usage
        # (async generators cannot return a value).
        self._chunks = chunks
        self._stopped = False
        self.usage: Usage | None = None

    def __aiter__(self) -> AsyncIterator[str]:
        if self._stopped:
            raise GenerationError("this stream was stopped before its end (a loop left early, or aclose())")
        return self._follow()

    async def __anext__(self) -> str:
        chunk = await self._chunks.__anext__()
        if isinstance(chunk, Usage):
            self.usage = chunk
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self._stopped = True
        await self._chunks.aclose()

    async def _follow(self) -> AsyncIterator[str]:
        done = False
        try:
            async for chunk in self._chunks:
                if isinstance(chunk, Usage):  # the last item: the generator ends right after it
                    self.usage = chunk
                    continue
                yield chunk
            done = True
        finally:
            if not done:  # the loop was left early (asyncio closes a dropped async generator)
                await self.aclose()


class CaptionResult(Result):
    """`{"caption": str}`, or a TextStream of text chunks when streamed."""

    __slots__ = ()
    SKILL = "caption"

    def __init__(self, caption: str | TextStream | AsyncTextStream, *, image: Any = None) -> None:
        super().__init__(caption=caption, image=image)


class QueryResult(Result):
    """`{"answer": str}`, or a TextStream of text chunks when streamed; a grounded query
    (`reasoning=True`) is `{"reasoning": {"text", "grounding": [{"start_idx", "end_idx", "points"}]},
    "answer": ...}`, its answer streamed alone."""

    __slots__ = ()
    SKILL = "query"

    def __init__(self, answer: str | TextStream | AsyncTextStream, *, image: Any = None) -> None:
        super().__init__(answer=answer, image=image)

    def with_reasoning(self, reasoning: dict[str, Any]) -> QueryResult:
        """This result with the reasoning before the answer (the reference's key order)."""
        answer = self["answer"]
        self.clear()
        self["reasoning"] = reasoning
        self["answer"] = answer
        return self


class GazeResult(Result):
    """`{"gaze": {"x", "y"}}` (floats in [0, 1], origin top-left), or `{"gaze": None}` where the
    model finds no gaze target."""

    __slots__ = ()
    SKILL = "gaze"

    def __init__(self, gaze: dict[str, float] | None, *, image: Any = None) -> None:
        if gaze is not None:
            parse_result({"points": [gaze]})
        super().__init__(gaze=gaze, image=image)

    def annotated(self) -> Image.Image:
        if self.image is None:
            raise ValueError("this result has no image to draw on; use foveal.vision.draw(image, result)")
        if self["gaze"] is None:
            return load_image(self.image)
        return draw(self.image, {"points": [self["gaze"]]})


class DetectResult(Result):
    """`{"objects": [{"x_min", "y_min", "x_max", "y_max", "score"}, ...]}`, floats in [0, 1], origin top-left;
    "score" is the model's confidence in the box (docs/scores.md)."""

    __slots__ = ()
    SKILL = "detect"

    def __init__(self, objects: list[dict[str, float]], *, image: Any = None) -> None:
        parse_result({"objects": objects})
        _check_scores(objects, "objects")
        super().__init__(objects=objects, image=image)


class PointResult(Result):
    """`{"points": [{"x", "y", "score"}, ...]}`, floats in [0, 1], origin top-left; "score" as detect's."""

    __slots__ = ()
    SKILL = "point"

    def __init__(self, points: list[dict[str, float]], *, image: Any = None) -> None:
        parse_result({"points": points})
        _check_scores(points, "points")
        super().__init__(points=points, image=image)


class SegmentResult(Result):
    """`{"path": SVG path data, "bbox": {"x_min", "y_min", "x_max", "y_max"}}`: the object's outline in
    normalized coordinates (origin top-left; every point in [0, 1]) and its box, as the reference
    client API answers segment; "bbox" is None where the model gave none. Streamed: a `SegmentStream`."""

    __slots__ = ()
    SKILL = "segment"

    def __init__(self, path: str, bbox: dict[str, float] | None, *, image: Any = None) -> None:
        svg.check_inside(path)
        if bbox is not None:
            parse_result({"objects": [bbox]})
        super().__init__(path=path, bbox=bbox, image=image)

    @classmethod
    def of_answer(cls, text: str, value: Any, image: Any = None) -> Self:
        return cls(value["path"], value.get("bbox"), image=image)

    @classmethod
    def of_updates(
        cls, text: TextStream | AsyncTextStream, progress: Callable[[str], dict], parse: Callable[[str], Any],
        image: Any = None,
    ) -> SegmentStream | AsyncSegmentStream:
        if isinstance(text, AsyncTextStream):
            return AsyncSegmentStream(text, progress, parse, image)
        return SegmentStream(text, progress, parse, image)

    def annotated(self) -> Image.Image:
        """The image with the outline drawn (its points joined) and the box."""
        if self.image is None:
            raise ValueError("this result has no image to draw on; use foveal.vision.draw(image, result)")
        picture = draw(self.image, {"objects": [self["bbox"]]}) if self["bbox"] else load_image(self.image)
        w, h = picture.size
        outline = [(x * (w - 1), y * (h - 1)) for x, y in svg.path_points(svg.parse_path(self["path"]))]
        if len(outline) >= 2:
            ImageDraw.Draw(picture).line([*outline, outline[0]], fill=(255, 64, 160), width=2)
        return picture


class _SegmentUpdates:
    """A segment stream's updates from its text chunks, as the reference client API yields them:
    `{"bbox"}` once the box is known, `{"chunk"}` for each piece of the path settled since, then
    `{"path", "bbox", "completed": True}` (the box before it if it never came earlier)."""

    __slots__ = ("_progress", "text", "_bbox_sent", "_path")

    def __init__(self, progress: Callable[[str], dict]) -> None:
        self._progress = progress
        self.text = ""
        self._bbox_sent = False
        self._path = ""  # the path sent so far in chunks

    def add(self, chunk: str) -> list[dict[str, Any]]:
        self.text += chunk
        now = self._progress(self.text)
        return self._bbox(now.get("bbox")) + self._chunk(now.get("path") or "", strict=True)

    def finish(self, result: SegmentResult) -> list[dict[str, Any]]:
        # A final path that does not extend the chunks (a refined outline) is sent whole, at the end.
        updates = self._bbox(result["bbox"]) + self._chunk(result["path"], strict=False)
        return [*updates, {"path": result["path"], "bbox": result["bbox"], "completed": True}]

    def _bbox(self, bbox: dict | None) -> list[dict[str, Any]]:
        if self._bbox_sent or bbox is None:
            return []
        self._bbox_sent = True
        return [{"bbox": bbox}]

    def _chunk(self, path: str, strict: bool) -> list[dict[str, Any]]:
        if len(path) <= len(self._path) or not path.startswith(self._path):
            if strict and path != self._path and not self._path.startswith(path):
                raise GenerationError(
                    f"segment: the streamed path {self._path[:60]!r} was rewritten as {path[:60]!r}; "
                    "a family's progress must only extend it, please report it"
                )
            return []
        piece, self._path = path[len(self._path) :], path
        return [{"chunk": piece}]


class SegmentStream:
    """A streamed segment: iterate it for update dicts, `{"bbox": {...}}` first, then `{"chunk": str}`
    pieces of the path, then `{"path", "bbox", "completed": True}` (the client 2.6.1's stream). At
    the end `.result` is the whole SegmentResult and `.usage` its Usage. Leaving the loop early or
    `close()` stops the generation, as for a TextStream."""

    __slots__ = ("_text", "_progress", "_parse", "_image", "result", "usage")

    def __init__(
        self, text: TextStream, progress: Callable[[str], dict], parse: Callable[[str], Any], image: Any = None
    ) -> None:
        self._text, self._progress, self._parse, self._image = text, progress, parse, image
        self.result: SegmentResult | None = None
        self.usage: Usage | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        updates = _SegmentUpdates(self._progress)
        try:
            for chunk in self._text:
                yield from updates.add(chunk)
            yield from updates.finish(self._finish(updates.text))
        except GeneratorExit:
            self._text.close()
            raise

    def _finish(self, text: str) -> SegmentResult:
        result = SegmentResult.of_answer(text, self._parse(text), self._image)
        result.usage = self.usage = self._text.usage
        self.result = result
        return result

    def close(self) -> None:
        self._text.close()

    def __enter__(self) -> SegmentStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSegmentStream:
    """`SegmentStream` for `asegment`: `async for update in stream`; `await stream.aclose()` stops it."""

    __slots__ = ("_text", "_progress", "_parse", "_image", "result", "usage")

    def __init__(
        self, text: AsyncTextStream, progress: Callable[[str], dict], parse: Callable[[str], Any], image: Any = None
    ) -> None:
        self._text, self._progress, self._parse, self._image = text, progress, parse, image
        self.result: SegmentResult | None = None
        self.usage: Usage | None = None

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        updates = _SegmentUpdates(self._progress)
        done = False
        try:
            async for chunk in self._text:
                for update in updates.add(chunk):
                    yield update
            result = SegmentResult.of_answer(updates.text, self._parse(updates.text), self._image)
            result.usage = self.usage = self._text.usage
            self.result = result
            for update in updates.finish(result):
                yield update
            done = True
        finally:
            if not done:  # left early (or failed): stop the generation
                await self._text.aclose()

    async def aclose(self) -> None:
        await self._text.aclose()


def _check_scores(items: list[dict], key: str) -> None:
    """A score, where an item has one, is a number in [0, 1] (a result made by hand may leave it out)."""
    for i, item in enumerate(items):
        score = item.get("score", 0.0)
        if isinstance(score, bool) or not isinstance(score, int | float) or not 0.0 <= score <= 1.0:
            raise ValueError(f"{key}[{i}]['score'] = {score!r}; a score is a number in [0, 1]")


class GenerateResult(Result):
    """`{"text": raw model text, "output": the parsed value (a pydantic instance for a pydantic class)}`."""

    __slots__ = ()
    SKILL = "generate"

    def __init__(self, text: str, output: Any = None, *, image: Any = None) -> None:
        super().__init__(text=text, output=output, image=image)

    @classmethod
    def of_answer(cls, text: str, value: Any, image: Any = None) -> Self:
        return cls(text, value, image=image)


class ChatResult(GenerateResult):
    """`{"text": the reply, "output": its parsed value}` (the text itself without an output type), or
    `{"text": TextStream, "output": None}` when streamed."""

    __slots__ = ()
    SKILL = "chat"

    @classmethod
    def of_answer(cls, text: str, value: Any, image: Any = None) -> Self:
        if isinstance(value, TextStream | AsyncTextStream):
            return cls(value, None, image=image)
        return cls(text, value, image=image)
