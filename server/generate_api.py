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
from pydantic import BaseModel, ConfigDict

import foveal
from foveal.server.errors import ApiError
from foveal.server.images import image_bytes
from foveal.server.state import call

router = APIRouter(prefix="/v1", tags=["foveal"])


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    image_url: str | None = None
    json_schema: dict[str, Any] | bool | None = None
    regex: str | None = None
    grammar: str | None = None
    settings: dict[str, Any] | None = None
    model: str | None = None


@router.post("/generate")
async def generate(body: GenerateBody, request: Request) -> dict[str, Any]:
    output_type = _output_type(body)
    image = image_bytes(body.image_url)
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
