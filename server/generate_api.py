"""foveal's own structured call, for what neither Moondream's API nor OpenAI's can say.

    POST /v1/generate {prompt, image_url?, json_schema? | regex? | grammar?, settings?}
        -> {"text": the model's raw answer, "output": the parsed value}

At most one output type: `json_schema` (a JSON schema; output: the parsed JSON value), `regex`
(output: the matched string) or `grammar` (a Lark grammar; output: the string); none: free text.
Each is compiled by the SDK (`foveal.Regex`, `foveal.CFG`, a schema dict); one the grammar cannot
enforce is a 422 naming the cause, and an answer cut by max_tokens is a 422 `incomplete_output`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

import foveal
from foveal.server.bodies import JsonRoute
from foveal.server.errors import ApiError
from foveal.server.images import decode_image
from foveal.server.measure import check_fits
from foveal.server.moondream_api import EXAMPLE_IMAGE_URL, GenerateSettings, ImageUrl
from foveal.server.state import call, state_of

router = APIRouter(prefix="/v1", tags=["foveal"], route_class=JsonRoute)  # bodies: bodies.py

# Whole requests for the schema (one per output type), which a client or a fuzzer can start from.
EXAMPLES = [
    {"prompt": "how many shapes?", "image_url": EXAMPLE_IMAGE_URL, "regex": "[0-9]"},
    {"prompt": "how many?", "image_url": EXAMPLE_IMAGE_URL, "json_schema": {"type": "integer", "maximum": 9}},
    {"prompt": "sum", "image_url": EXAMPLE_IMAGE_URL, "grammar": 'start: D "+" D\nD: /[0-9]/'},
]


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": EXAMPLES})
    prompt: str
    image_url: ImageUrl | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, description="a JSON schema of the output")
    regex: str | None = Field(None, description="a regex the output matches")
    grammar: str | None = Field(None, description="a Lark grammar of the output (llguidance's dialect)")
    settings: GenerateSettings = None
    model: str | None = None


@router.post("/generate")
async def generate(body: GenerateBody, request: Request) -> dict[str, Any]:
    output_type = _output_type(body)
    await check_fits(state_of(request).ready_model(), [("prompt", body.prompt)])
    image = await decode_image(body.image_url)
    result = await call(request, lambda m: m.agenerate(image, body.prompt, output_type, body.settings))
    return {"text": result["text"], "output": result["output"]}


def _output_type(body: GenerateBody) -> Any:
    given = [name for name in ("json_schema", "regex", "grammar") if getattr(body, name) is not None]
    if len(given) > 1:
        raise ApiError(400, f"give at most one output type; got {' and '.join(given)}", param=given[1])
    if body.regex is not None:
        return foveal.Regex(body.regex)
    if body.grammar is not None:
        return foveal.CFG(body.grammar)
    return body.json_schema
