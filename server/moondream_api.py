"""Moondream's REST API, as the official `moondream` Python client (`moondream.vl(endpoint=...)`) sends it.

    POST /v1/caption {image_url, length?, stream?, settings?, model?}  -> {"caption": str}
    POST /v1/query   {image_url?, question, stream?, settings?, reasoning?, spatial_refs?}
                                                                        -> {"answer": str} ({"reasoning", "answer"})
    POST /v1/detect  {image_url, object, settings?, model?}             -> {"objects": [{x_min, y_min, x_max, y_max}]}
    POST /v1/point   {image_url, object, settings?, spatial_refs?}      -> {"points": [{x, y}]}
    POST /v1/segment {image_url, object, spatial_refs?, stream?, settings?}
                                                                        -> {"path": SVG path, "bbox": {x_min, ...}}
    POST /v1/gaze    {image_url, eye: [x, y]}                           -> {"gaze": {x, y} | null}

Every answer also carries, as Moondream's API does, `"finish_reason"` ("stop", or "length" where
max_tokens ended it) and `"metrics": {"input_tokens", "output_tokens", "prefill_time_ms",
"decode_time_ms", "ttft_ms"}` (usage.py; the engine's counts and clock). The client 2.6.1 reads
neither (it returns only the skill's keys); other clients read them from the body.

`image_url` is a base64 data URL (images.py). With `stream: true`, caption and query answer
Server-Sent Events: `data: {"chunk": "..."}` per text chunk, then `data: {"completed": true, <key>:
the whole text, "finish_reason", "metrics"}` (the client stops reading there; a grounded query's
also carries its "reasoning"). A streamed segment sends `{"type": "bbox", "bbox"}` once the box is
known, `{"type": "path_delta", "chunk", "completed": false}` per piece of the path, then
`{"type": "final", "path", "bbox", "completed": true, "finish_reason", "metrics"}`: the client
2.6.1 yields `{"bbox"}`, `{"chunk"}` and `{"path", "bbox", "completed"}` from them. Results are the
SDK's result dicts, unchanged, plus those two keys. `model` names the served model (one is served:
its name is not checked) or, in the form moondream's finetune client writes
(`Finetune.model(step)`: `<base>/<finetune_id>@<step>`, e.g. `moondream3-preview/01J5Z3@1000`), a
fine-tune of it: the call then runs with `settings["adapter"] = "<finetune_id>@<step>"` (a setting of
its own that names another adapter is a 400; a model without adapters answers the SDK's 400; /v1/gaze,
which takes no settings, refuses one). `reasoning`, `spatial_refs`, segment and gaze go to the SDK's query / point / segment /
detect_gaze, which answer them on models that have them and refuse them, a 400 naming the model's
family and what it supports, on the others; a streamed grounded query streams its answer (the
reasoning is made first). The official client (2.6.1) has no gaze call; `/v1/gaze` takes the SDK's
`detect_gaze(image, eye=(x, y))`.

Errors: a 4xx or 5xx status with errors.py's body, `{"error": {"message", "type", "param", "code"}}`,
on these routes as on every other (the `moondream` client reads only the status and raises
urllib's HTTPError, whose body is that JSON). An error after a stream's 200 went out is one event,
`data: {"error": {...}}`, the same object, and no `completed` event after it.

The bodies' OpenAPI schema says what the server accepts (a data URL in `image_url`, the settings
keys and their ranges) so that a client, or a fuzzer, can build requests from it; the values
themselves are checked by the SDK, whose refusals are 400s naming the key.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from foveal.results import Usage
from foveal.server.bodies import JsonRoute
from foveal.server.errors import error_event
from foveal.server.images import decode_image
from foveal.server.measure import check_fits
from foveal.server.state import call, state_of, stream_call
from foveal.server.streaming import events
from foveal.server.usage import finish_reason, moondream_metrics
from foveal.settings import MAX_OBJECTS_CEILING, MAX_TOKENS_CEILING, OBJECT_SKILLS, SEED_LIMIT
from foveal.skills import CAPTION_LENGTHS

router = APIRouter(prefix="/v1", tags=["moondream"], route_class=JsonRoute)  # bodies: bodies.py

# An 8 x 8 red PNG: the example image of the schema.
EXAMPLE_IMAGE_URL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAFElEQVR4nGM8ISfHgA0wYRUdtBIA"
    "0MoBFD5jqJkAAAAASUVORK5CYII="
)
ImageUrl = Annotated[
    str,
    Field(
        description="the image as a base64 data URL (remote URLs are not fetched)",
        examples=[EXAMPLE_IMAGE_URL],
        json_schema_extra={"pattern": "^data:[^,]*;base64,"},
    ),
]


def settings_schema(skill: str) -> dict[str, Any]:
    """The JSON schema of a skill's `settings` (the SDK's keys and ranges, foveal.settings)."""
    properties: dict[str, Any] = {
        "temperature": {"type": "number", "minimum": 0, "description": "0 is greedy decoding"},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_CEILING},
        "seed": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": SEED_LIMIT - 1}, {"type": "null"}]},
        "variant": {
            "anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}],
            "description": "a LoRA variant's name or path, where the model takes variants (Moondream 2)",
        },
        "adapter": {
            "anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}],
            "description": "a fine-tune's adapter, '<finetune_id>@<step>', where the model takes them (Moondream 3)",
        },
    }
    if skill in OBJECT_SKILLS:
        properties["max_objects"] = {"type": "integer", "minimum": 1, "maximum": MAX_OBJECTS_CEILING}
        properties["min_score"] = {
            "type": "number", "minimum": 0, "maximum": 1, "description": "items scored below it are left out",
        }
    accepted = {"type": "object", "properties": properties, "additionalProperties": False}
    return {"anyOf": [accepted, {"type": "null"}], "description": "sampling settings; unknown keys are a 400"}


def _settings(skill: str) -> Any:
    """The type of a skill's `settings`: any dict (the SDK checks it), documented by its schema."""
    return Annotated[dict[str, Any] | None, WithJsonSchema(settings_schema(skill))]


CaptionSettings = _settings("caption")
QuerySettings = _settings("query")
DetectSettings = _settings("detect")
PointSettings = _settings("point")
SegmentSettings = _settings("segment")
GenerateSettings = _settings("generate")


def _examples(*bodies: dict[str, Any]) -> ConfigDict:
    """A body's config with whole example requests for its schema (merged with _Body's)."""
    return ConfigDict(json_schema_extra={"examples": list(bodies)})


# Bounded in the schema, so that pydantic refuses a huge array by its length before validating its
# items (500,000 points took seconds of the event loop in validation). Each ref is prompt tokens:
# no served model's context holds this many.
MAX_SPATIAL_REFS = 256
SpatialRef = Annotated[list[float], Field(min_length=2, max_length=4)]
SpatialRefs = Annotated[
    list[SpatialRef] | None,
    Field(
        description="points [x, y] and boxes [x1, y1, x2, y2] (normalized) the call refers to, on models "
        "that take them",
        max_length=MAX_SPATIAL_REFS,
    ),
]


# A fine-tune checkpoint's id as moondream's client writes it after the base model's name: never a path
# (no '/'), so a body's `model` cannot point the server at a file.
FINETUNE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*@[A-Za-z0-9_-][A-Za-z0-9._-]*")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Annotated[
        str | None,
        Field(description="the served model's name, or a fine-tune of it: '<base>/<finetune_id>@<step>'"),
    ] = None


def adapter_of(model: str | None) -> str | None:
    """The adapter a body's `model` names (`<base>/<finetune_id>@<step>`), None for a plain model name
    (`moondream3-preview`, or a hub id such as `moondream/moondream3-preview`, which has no '@')."""
    if model is None or "/" not in model or "@" not in model:
        return None
    base, _, adapter = model.partition("/")
    if not base or FINETUNE.fullmatch(adapter) is None:
        raise ValueError(
            f"model {model!r:.120} is neither a model's name nor a fine-tune's '<base>/<finetune_id>@<step>'"
        )
    return adapter


def with_adapter(body: _Body, settings: dict[str, Any] | None) -> dict[str, Any] | None:
    """The call's settings with the adapter its `model` names, if any."""
    adapter = adapter_of(body.model)
    if adapter is None:
        return settings
    given = (settings or {}).get("adapter")
    if given is not None and given != adapter:
        raise ValueError(
            f"model {body.model!r:.120} names adapter {adapter!r} but settings['adapter'] is {given!r:.120}; give one"
        )
    return {**(settings or {}), "adapter": adapter}


class CaptionBody(_Body):
    model_config = _examples({"image_url": EXAMPLE_IMAGE_URL, "length": "short"})
    image_url: ImageUrl
    length: Annotated[str, Field(json_schema_extra={"enum": list(CAPTION_LENGTHS)})] = "normal"
    stream: bool = False
    settings: CaptionSettings = None


class QueryBody(_Body):
    model_config = _examples({"image_url": EXAMPLE_IMAGE_URL, "question": "how many shapes are there?"})
    question: str
    image_url: ImageUrl | None = None
    stream: bool = False
    reasoning: Annotated[bool, Field(description="a grounded reasoning before the answer (models that reason)")] = False
    spatial_refs: SpatialRefs = None
    settings: QuerySettings = None


class DetectBody(_Body):
    model_config = _examples({"image_url": EXAMPLE_IMAGE_URL, "object": "red square"})
    image_url: ImageUrl
    object: str
    settings: DetectSettings = None


class PointBody(_Body):
    model_config = _examples({"image_url": EXAMPLE_IMAGE_URL, "object": "red square"})
    image_url: ImageUrl
    object: str
    settings: PointSettings = None
    spatial_refs: SpatialRefs = None


class SegmentBody(_Body):
    model_config = _examples({"image_url": EXAMPLE_IMAGE_URL, "object": "red square"})
    image_url: ImageUrl
    object: str
    spatial_refs: SpatialRefs = None
    stream: bool = False
    settings: SegmentSettings = None


class GazeBody(_Body):
    model_config = _examples({"image_url": EXAMPLE_IMAGE_URL, "eye": [0.3, 0.4]})
    image_url: ImageUrl
    eye: Annotated[list[float], Field(description="the eye's [x, y], normalized to [0, 1]", min_length=2, max_length=2)]


@router.post("/caption")
async def caption(body: CaptionBody, request: Request) -> Any:
    settings = with_adapter(body, body.settings)
    image = await decode_image(body.image_url)
    return await _text(
        request,
        "caption",
        body.stream,
        lambda m, stream: m.acaption(image, body.length, stream, settings),
    )


@router.post("/query")
async def query(body: QueryBody, request: Request) -> Any:
    settings = with_adapter(body, body.settings)
    await check_fits(state_of(request).ready_model(), [("question", body.question)])
    image = await decode_image(body.image_url)
    return await _text(
        request,
        "answer",
        body.stream,
        lambda m, stream: m.aquery(image, body.question, body.reasoning, body.spatial_refs, stream, settings),
    )


@router.post("/detect")
async def detect(body: DetectBody, request: Request) -> Any:
    settings = with_adapter(body, body.settings)
    image = await decode_image(body.image_url)
    return _answered(await call(request, lambda m: m.adetect(image, body.object, settings)))


@router.post("/point")
async def point(body: PointBody, request: Request) -> Any:
    settings = with_adapter(body, body.settings)
    image = await decode_image(body.image_url)
    return _answered(
        await call(request, lambda m: m.apoint(image, body.object, settings, spatial_refs=body.spatial_refs))
    )


@router.post("/segment")
async def segment(body: SegmentBody, request: Request) -> Any:
    settings = with_adapter(body, body.settings)
    image = await decode_image(body.image_url)

    def start(model: Any, stream: bool) -> Any:
        return model.asegment(image, body.object, body.spatial_refs, stream, settings)

    if not body.stream:
        return _answered(await call(request, lambda m: start(m, False)))
    # submitted before the 200: a model without segment, or a request that cannot fit, is a 400
    return await stream_call(
        request, lambda m: start(m, True), lambda updates: events(updates, _segment_event(updates), [], error_event)
    )


@router.post("/gaze")
async def gaze(body: GazeBody, request: Request) -> Any:
    if adapter_of(body.model) is not None:
        raise ValueError("/v1/gaze takes no settings, so no fine-tune's adapter; name the base model or none")
    image = await decode_image(body.image_url)
    return _answered(await call(request, lambda m: m.adetect_gaze(image, eye=tuple(body.eye))))


def _answered(result: Any) -> dict[str, Any]:
    """A result dict with Moondream's `finish_reason` and `metrics` after its own keys."""
    return {**result, **_ending(result.usage)}


def _ending(usage: Usage | None) -> dict[str, Any]:
    """What Moondream's API says at the end of an answer: why it ended and its metrics."""
    if usage is None:  # every answer the SDK completes has its usage; nothing to say without one
        return {}
    return {"finish_reason": finish_reason(usage), "metrics": moondream_metrics(usage)}


def _segment_event(updates: Any) -> Any:
    """A segment stream's update as the event the client 2.6.1 reads (its `type`); the final one with
    the ending (the stream's usage is set before its last update)."""

    def event(update: dict[str, Any]) -> dict[str, Any]:
        if update.get("completed"):
            return {"type": "final", **update, **_ending(updates.usage)}
        if "bbox" in update:
            return {"type": "bbox", "bbox": update["bbox"]}
        return {"type": "path_delta", "chunk": update["chunk"], "completed": False}

    return event


async def _text(request: Request, key: str, stream: bool, start: Any) -> Any:
    """A caption or an answer (`start(model, stream)`): the result dict, or with `stream` its text
    chunks as events, the last one with the whole text and the ending; a streamed call holds its
    admission slot until the stream ends."""
    if not stream:
        return _answered(await call(request, lambda m: start(m, False)))

    async def begin(model: Any) -> Any:
        return await start(model, True)  # submitted: refused at submit is a 400, no event

    def lines(result: Any) -> Any:
        told: list[str] = []

        def frame(chunk: str) -> dict[str, str]:
            told.append(chunk)
            return {"chunk": chunk}

        def done() -> list[dict[str, Any]]:
            final: dict[str, Any] = {"completed": True}
            if "reasoning" in result:
                final["reasoning"] = result["reasoning"]
            return [{**final, key: "".join(told), **_ending(result[key].usage)}]

        return events(result[key], frame, done, error_event)

    return await stream_call(request, begin, lines)
