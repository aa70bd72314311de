"""OpenAI chat requests turned into one `Model` call: which skill, which image, which prompt, which
output type, which settings. No HTTP here (openai_api.py does that).

- messages: `content` is a string or a list of parts (`{"type": "text", "text"}`,
  `{"type": "image_url", "image_url": {"url": "data:..."}}`); at most one image in the whole
  conversation (foveal's models take one). The prompt is the text of the last user message when
  it is the only message with text; otherwise the conversation as "role: text" lines.
- response_format: `text` (or none) -> `query` (the model's question-answering skill, which
  streams); `json_object` -> `generate` with the schema `{"type": "object"}`; `json_schema` ->
  `generate` with the given schema, always enforced by the grammar (`strict` true or false).
- settings: max_completion_tokens (or max_tokens), temperature, top_p, seed, passed to the SDK,
  which validates them. n must be 1. `stop` is applied by the server (stops.py), to text answers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from foveal.server.errors import ApiError
from foveal.server.images import image_bytes


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat completion request that foveal serves; any other field is refused."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[dict[str, Any]]
    response_format: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None  # accepted, unused
    # Accepted only at their neutral values (clients send them by default):
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None


@dataclass(frozen=True, slots=True)
class ChatCall:
    skill: Literal["query", "generate"]
    image: bytes | None
    prompt: str
    output_type: dict[str, Any] | None
    settings: dict[str, Any]
    stops: list[str]


def chat_call(body: ChatRequest) -> ChatCall:
    _check_unsupported(body)
    prompt, image = _conversation(body.messages)
    output_type = _output_type(body.response_format)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if stops and output_type is not None:
        raise ApiError(
            400,
            "stop cannot be combined with a JSON response_format (the grammar decides where the JSON "
            "ends); remove stop",
            param="stop",
        )
    if len(stops) > 4:
        raise ApiError(400, f"stop takes at most 4 strings, got {len(stops)}", param="stop")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    settings = {
        key: value
        for key, value in (
            ("max_tokens", max_tokens),
            ("temperature", body.temperature),
            ("top_p", body.top_p),
            ("seed", body.seed),
        )
        if value is not None
    }
    skill = "query" if output_type is None else "generate"
    return ChatCall(skill, image, prompt, output_type, settings, stops)


def _check_unsupported(body: ChatRequest) -> None:
    if body.n not in (None, 1):
        raise ApiError(
            400, f"n={body.n} is not supported; foveal answers one choice per request (n=1)", param="n"
        )
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported; leave it out or send 0", param=name)
    if body.logprobs:
        raise ApiError(400, "logprobs are not supported; leave logprobs out", param="logprobs")


def _conversation(messages: list[dict[str, Any]]) -> tuple[str, bytes | None]:
    if not messages:
        raise ApiError(400, "messages is empty; send at least one user message", param="messages")
    texts: list[tuple[str, str]] = []
    image: bytes | None = None
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(
                400,
                f"messages[{i}].role {role!r} is not supported; use system, user or assistant",
                param=f"messages[{i}].role",
            )
        text, found = _content(message.get("content"), i)
        if found is not None:
            if image is not None:
                raise ApiError(
                    400,
                    "more than one image in messages; foveal's models take one image per request",
                    param=f"messages[{i}].content",
                )
            image = found
        if text:
            texts.append((role, text))
    if not texts:
        raise ApiError(400, "messages hold no text; add a user message with the question", param="messages")
    if len(texts) == 1:
        return texts[0][1], image
    return "\n".join(f"{role}: {text}" for role, text in texts), image


def _content(content: Any, i: int) -> tuple[str, bytes | None]:
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise ApiError(
            400,
            f"messages[{i}].content must be a string or a list of content parts",
            param=f"messages[{i}].content",
        )
    texts: list[str] = []
    image: bytes | None = None
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ApiError(400, f"{where}.image_url.url must be a data URL string", param=where)
            if image is not None:
                raise ApiError(
                    400,
                    "more than one image in messages; foveal's models take one image per request",
                    param=where,
                )
            image = image_bytes(url, f"{where}.image_url.url")
        else:
            raise ApiError(
                400,
                f"{where}: content parts must be {{'type': 'text', 'text': ...}} or {{'type': 'image_url', 'image_url': {{'url': 'data:...'}}}}",
                param=where,
            )
    return "\n".join(texts), image


def _output_type(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(
                400,
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        return schema
    raise ApiError(
        400,
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
        param="response_format",
    )
