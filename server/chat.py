"""OpenAI chat requests turned into `Model.chat` calls: the conversation, its images, the output type,
the tools, the settings, the number of choices. No HTTP here (openai_api.py does that).

- messages: 1..MAX_MESSAGES of them; roles system (and OpenAI's `developer`, read as system), user, assistant (with
  `tool_calls`) and tool (with the `tool_call_id` it answers); `content` a string or a list of parts
  (`{"type": "text", "text"}`, `{"type": "image_url", "image_url": {"url": "data:..."}}`; http(s)
  URLs are refused: the server fetches nothing). The conversation goes to `model.chat` as it is,
  images in the user turns where they were, and is rendered by the model's own chat template; what
  a model cannot take (several images, earlier turns without a template) is refused by the model
  with a message that says so.
- response_format: `text` (or none) -> free text; `json_object` -> the schema `{"type": "object"}`;
  `json_schema` -> the given schema, always enforced by the grammar (`strict` true or false).
- tools / tool_choice / parallel_tool_calls: checked here before any work (foveal.tools: a
  parameters schema the grammar cannot enforce is a 400 naming it and its keyword; an unknown name
  in tool_choice is a 400) and passed to `model.chat`, which enforces them by the grammar.
- n: 1..MAX_CHOICES choices, each its own engine request on the same prompt (the prefix cache shares
  the prompt's pages); a seeded request gives choice i the seed `seed + i`, so it repeats exactly.
- logprobs / top_logprobs: k = top_logprobs (0..20) alternatives per token.
- reasoning (the `moondream` client's `chat(reasoning=True)`): on a model with grounded reasoning
  (Moondream 2) the chat is one user question, with at most one image, answered by
  `query(image, question, reasoning=True)`: the reasoning's text goes out as `reasoning` (the client's
  field) and `reasoning_content`, its groundings as `reasoning_details.grounding`. On a model whose
  template has a thinking section it changes nothing (the thinking is always returned); elsewhere 400.
- settings: max_completion_tokens (or max_tokens), temperature, top_p, seed, stop, passed to the SDK,
  which validates them. `user` (and OpenAI's replacements for it, `safety_identifier` and
  `prompt_cache_key`), `metadata` and `store` (false) are accepted and unused: the server keeps
  nothing, and its prefix cache needs no key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from foveal import tools as chat_tools
from foveal.grammars import SchemaError
from foveal.server.errors import ApiError
from foveal.server.images import image_bytes

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_MESSAGES = 2048  # messages of one request: OpenAI's own bound, above what any context holds
MAX_CHOICES = 8  # n: choices of one request (each an engine request; the prompt's pages are shared)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound, and the engine's


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
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    user: str | None = None  # accepted, unused
    # OpenAI's replacements for `user` (the openai client documents them in its place): accepted, unused
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None  # accepted, unused
    store: bool | None = None  # accepted when not true: the server stores nothing
    reasoning: bool | None = None  # the moondream client's chat(reasoning=...): see the module docstring
    # Accepted only at their neutral values (clients send them by default):
    frequency_penalty: float | None = None
    presence_penalty: float | None = None


@dataclass(frozen=True, slots=True)
class ChatCall:
    messages: list[dict[str, Any]]  # foveal's messages (images as bytes), for Model.chat
    output_type: dict[str, Any] | None
    settings: dict[str, Any]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    n: int = 1
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    reasoning: bool = False  # a grounded reasoning before the answer (`question` holds the question)

    def question(self) -> tuple[Any, str]:
        """(the image or None, the question) of a chat that is one user question, for query(reasoning=True)."""
        turns = [m for m in self.messages if m["role"] != "system" or m["content"]]
        if len(turns) != 1 or turns[0]["role"] != "user":
            raise ApiError(
                400,
                "reasoning: true answers one user question (Moondream's query); send a single user message",
                param="messages",
            )
        content = turns[0]["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        images = [p["image"] for p in parts if p["type"] == "image"]
        if len(images) > 1:
            raise ApiError(400, "reasoning: true takes at most one image", param="messages")
        text = "".join(p["text"] for p in parts if p["type"] == "text").strip()
        if not text:
            raise ApiError(400, "reasoning: true needs a question in the user message", param="messages")
        return (images[0] if images else None), text

    def texts(self) -> list[tuple[str, str]]:
        """(where, text) of every text in the conversation, in order (measure.py checks them)."""
        out = []
        for i, message in enumerate(self.messages):
            content = message["content"]
            if isinstance(content, str):
                out.append((f"messages[{i}].content", content))
                continue
            out += [(f"messages[{i}].content[{j}].text", p["text"]) for j, p in enumerate(content) if p["type"] == "text"]
        return out

    def choice_settings(self, index: int) -> dict[str, Any]:
        """Choice `index`'s settings: a seeded request's choices get seeds seed, seed + 1, ..."""
        seed = self.settings.get("seed")
        if seed is None or index == 0:
            return self.settings
        return {**self.settings, "seed": (seed + index) % 2**64}

    def args(self, index: int) -> tuple[tuple, dict[str, Any]]:
        """`Model.chat`'s arguments for choice `index`: (messages, output_type, settings) and the keywords
        this request uses beyond those (tools, logprobs), so a plain request is a plain call."""
        extra: dict[str, Any] = {}
        if self.tools:
            extra.update(tools=self.tools, tool_choice=self.tool_choice, parallel_tool_calls=self.parallel_tool_calls)
        if self.logprobs is not None:
            extra["logprobs"] = self.logprobs
        return (self.messages, self.output_type, self.choice_settings(index)), extra


def chat_call(body: ChatRequest) -> ChatCall:
    _check_unsupported(body)
    messages = _messages(body.messages)
    output_type = _output_type(body.response_format)
    _check_tools(body)
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
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.reasoning and (output_type is not None or body.tools or logprobs is not None):
        raise ApiError(
            400,
            "reasoning: true answers in text; it cannot be combined with response_format, tools or logprobs",
            param="reasoning",
        )
    return ChatCall(
        messages, output_type, settings, body.tools, body.tool_choice, parallel, body.n or 1, logprobs,
        bool(body.reasoning),
    )


def _check_unsupported(body: ChatRequest) -> None:
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise ApiError(
            400, f"n={body.n} is not accepted; ask for 1 to {MAX_CHOICES} choices per request", param="n"
        )
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported; leave it out or send 0", param=name)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true; send both", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(
                400, f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {body.top_logprobs}", param="top_logprobs"
            )
    if body.store:
        raise ApiError(400, "store: true is not supported; this server stores no completions", param="store")


def _check_tools(body: ChatRequest) -> None:
    """The tools and tool_choice, checked before any work (the SDK checks them again, cheaply: each
    parameters schema's compile is cached)."""
    try:
        tools = chat_tools.tools_of(body.tools)
    except SchemaError as error:
        where = str(error).split(":", 1)[0]
        raise ApiError(400, f"{error}", "unsupported_schema", param=where) from None
    except (TypeError, ValueError) as error:
        raise ApiError(400, str(error), param="tools") from None
    try:
        chat_tools.choice_of(body.tool_choice, tools)
    except ValueError as error:
        raise ApiError(400, str(error), param="tool_choice") from None


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise ApiError(400, "messages is empty; send at least one user message", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(
            400,
            f"messages holds {len(messages)} messages, more than this server takes ({MAX_MESSAGES}); "
            "send the conversation's last turns",
            param="messages",
        )
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(
                400,
                f"messages[{i}].role {role!r} is not supported; use system, user, assistant or tool",
                param=f"messages[{i}].role",
            )
        content = message.get("content")
        one = {"role": ROLES[role], "content": "" if content is None else _content(content, i)}
        for key in ("tool_calls", "tool_call_id"):  # foveal.tools checks them
            if message.get(key) is not None:
                one[key] = message[key]
        out.append(one)
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
