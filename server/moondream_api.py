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

from foveal.server.admission import cancel_on_disconnect
from foveal.server.errors import ApiError, api_error, error_body
from foveal.server.images import image_bytes
from foveal.server.state import call, state_of
from foveal.server.streaming import EventStream, events

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
    if body.stream:
        return await _stream(
            request, "caption", lambda m: m.acaption(image, body.length, True, body.settings)
        )
    return await call(request, lambda m: m.acaption(image, body.length, False, body.settings))


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
    if body.stream:
        return await _stream(request, "answer", lambda m: m.aquery(image, body.question, True, body.settings))
    return await call(request, lambda m: m.aquery(image, body.question, False, body.settings))


@router.post("/detect")
async def detect(body: ObjectBody, request: Request) -> Any:
    image = image_bytes(body.image_url)
    return await call(request, lambda m: m.adetect(image, body.object, body.settings))


@router.post("/point")
async def point(body: ObjectBody, request: Request) -> Any:
    image = image_bytes(body.image_url)
    return await call(request, lambda m: m.apoint(image, body.object, body.settings))


async def _stream(request: Request, key: str, start: Any) -> EventStream:
    """Start a streamed skill (its input checked before the 200 goes out), then stream its chunks.
    The call's admission slot is held until the stream ends."""
    state = state_of(request)
    model = state.ready_model()
    state.admission.admit()
    try:
        result = await cancel_on_disconnect(request, start(model), state.metrics)
    except BaseException:
        state.admission.release()
        raise
    chunks = result[key]

    def on_error(error: BaseException) -> dict:
        problem = api_error(error)
        return error_body(problem.message, problem.type)

    lines = events(chunks, lambda chunk: {"chunk": chunk}, [{"completed": True}], on_error)
    return EventStream(lines, on_close=state.admission.release)
