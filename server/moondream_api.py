"""Moondream's REST API, as the official `moondream` Python client (`moondream.vl(endpoint=...)`) sends it.

    POST /v1/caption {image_url, length?, stream?, settings?, model?}  -> {"caption": str}
    POST /v1/query   {image_url?, question, stream?, settings?, ...}   -> {"answer": str}
    POST /v1/detect  {image_url, object, settings?, model?}             -> {"objects": [{x_min, y_min, x_max, y_max}]}
    POST /v1/point   {image_url, object, settings?, model?}             -> {"points": [{x, y}]}

`image_url` is a base64 data URL (images.py). With `stream: true`, caption and query answer
Server-Sent Events: `data: {"chunk": "..."}` per text chunk, then `data: {"completed": true}` (the
client stops reading there); an error after the stream started is one `data: {"error": {...}}`.
Results are the SDK's result dicts, unchanged. `model` is accepted and ignored (one model is
served); `reasoning` and `spatial_refs` are refused: foveal has neither.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from foveal.server.errors import ApiError, error_event
from foveal.server.images import image_bytes
from foveal.server.state import call, stream_call
from foveal.server.streaming import events

router = APIRouter(prefix="/v1", tags=["moondream"])


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    settings: dict[str, Any] | None = None


class CaptionBody(_Body):
    image_url: str
    length: str = "normal"
    stream: bool = False


class QueryBody(_Body):
    question: str
    image_url: str | None = None
    stream: bool = False
    reasoning: bool = False
    spatial_refs: list[Any] | None = None


class ObjectBody(_Body):
    image_url: str
    object: str


@router.post("/caption")
async def caption(body: CaptionBody, request: Request) -> Any:
    image = image_bytes(body.image_url)
    return await _text(
        request,
        "caption",
        body.stream,
        lambda m, stream: m.acaption(image, body.length, stream, body.settings),
    )


@router.post("/query")
async def query(body: QueryBody, request: Request) -> Any:
    if body.reasoning:
        raise ApiError(
            400, "reasoning is not supported by foveal's models; send reasoning: false", param="reasoning"
        )
    if body.spatial_refs:
        raise ApiError(
            400, "spatial_refs are not supported by foveal's models; remove them", param="spatial_refs"
        )
    image = image_bytes(body.image_url)
    return await _text(
        request,
        "answer",
        body.stream,
        lambda m, stream: m.aquery(image, body.question, stream, body.settings),
    )


@router.post("/detect")
async def detect(body: ObjectBody, request: Request) -> Any:
    image = image_bytes(body.image_url)
    return await call(request, lambda m: m.adetect(image, body.object, body.settings))


@router.post("/point")
async def point(body: ObjectBody, request: Request) -> Any:
    image = image_bytes(body.image_url)
    return await call(request, lambda m: m.apoint(image, body.object, body.settings))


async def _text(request: Request, key: str, stream: bool, start: Any) -> Any:
    """A caption or an answer (`start(model, stream)`): the result dict, or with `stream` its text
    chunks as events; a streamed call holds its admission slot until the stream ends."""
    if not stream:
        return await call(request, lambda m: start(m, False))
    return await stream_call(
        request,
        lambda m: start(m, True),
        lambda result: events(
            result[key], lambda chunk: {"chunk": chunk}, [{"completed": True}], error_event
        ),
    )
