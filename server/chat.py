"""OpenAI chat requests turned into one `Model.chat` call: the conversation, its images, the output type,
the settings. No HTTP here (openai_api.py does that).

- messages: roles system (and OpenAI's `developer`, read as system), user and assistant; `content` a
  string or a list of parts (`{"type": "text", "text"}`, `{"type": "image_url", "image_url": {"url":
  "data:..."}}`; http(s) URLs are refused: the server fetches nothing). The conversation goes to
  `model.chat` as it is, images in the user turns where they were, and is rendered by the model's own
  chat template; what a model cannot take (several images, earlier turns without a template) is
  refused by the model with a message that says so.
- response_format: `text` (or none) -> free text (streams); `json_object` -> the schema
  `{"type": "object"}`; `json_schema` -> the given schema, always enforced by the grammar (`strict`
  true or false).
- settings: max_completion_tokens (or max_tokens), temperature, top_p, seed, stop, passed to the SDK,
  which validates them. n must be 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from foveal.server.errors import ApiError
from foveal.server.images import image_bytes

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


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
    messages: list[dict[str, Any]]  # foveal's messages (images as bytes), for Model.chat
    output_type: dict[str, Any] | None
    settings: dict[str, Any]


def chat_call(body: ChatRequest) -> ChatCall:
    _check_unsupported(body)
    messages = _messages(body.messages)
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
            ("stop", [s for s in stops if s] or None),
        )
        if value is not None
    }
    return ChatCall(messages, output_type, settings)


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


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise ApiError(400, "messages is empty; send at least one user message", param="messages")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role {role!r} is not supported; use system, user or assistant",
                param=f"messages[{i}].role",
            )
        out.append({"role": ROLES[role], "content": _content(message.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(
            400,
            f"messages[{i}].content must be a string or a list of content parts",
            param=f"messages[{i}].content",
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise ApiError(400, f"{where}.image_url.url must be a data URL string", param=where)
            parts.append({"type": "image", "image": image_bytes(url, f"{where}.image_url.url")})
        else:
            raise ApiError(
                400,
                f"{where}: content parts must be {{'type': 'text', 'text': ...}} or {{'type': 'image_url', 'image_url': {{'url': 'data:...'}}}}",
                param=where,
            )
    return parts


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
