"""OpenAI's chat API: `POST /v1/chat/completions` and `GET /v1/models`, as the `openai` client sends them.

chat.py turns the request into one `Model.chat` call, the conversation passed through as it came.
Text answers stream from the engine (a `stop` string ends the generation where it appears, in the
engine); JSON answers (under the schema's grammar) come whole, and streamed they are sent as one
content chunk. An answer cut by max_tokens is OpenAI's `finish_reason: "length"` with the text so
far, not an error (the openai client's `parse()` then raises its LengthFinishReasonError). `usage`
is the engine's own count (usage.py). Streams: `chat.completion.chunk` objects, a last chunk with
`finish_reason`, a usage chunk when `stream_options.include_usage`, then `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter, Request

from foveal.errors import IncompleteOutputError
from foveal.results import Usage
from foveal.server.chat import ChatCall, ChatRequest, chat_call
from foveal.server.errors import error_event
from foveal.server.state import ServerState, call, state_of, stream_call
from foveal.server.streaming import EventStream, sse
from foveal.server.usage import finish_reason, usage

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    entry = {"id": state.config.model_name, "object": "model", "created": 0, "owned_by": "foveal"}
    return {"object": "list", "data": [entry]}


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Any:
    plan = chat_call(body)
    state = state_of(request)
    if plan.output_type is None and body.stream:
        return await stream_call(
            request,
            lambda m: m.achat(plan.messages, None, plan.settings, stream=True),
            lambda result: _chat_events(state, body, result["text"]),
        )
    text, counted = await call(request, lambda m: _answer(m, plan))
    if body.stream:  # a JSON answer, whole: one content chunk
        return _one_chunk_stream(state, body, text, counted)
    return {
        "id": _id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.config.model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "finish_reason": finish_reason(counted),
                "logprobs": None,
            }
        ],
        "usage": _usage(state, counted),
    }


async def _answer(model: Any, plan: ChatCall) -> tuple[str, Usage]:
    try:
        result = await model.achat(plan.messages, plan.output_type, plan.settings)
    except IncompleteOutputError as cut:  # OpenAI's finish_reason "length", with the text so far
        return cut.text, cut.usage
    return result["text"], result.usage


def _usage(state: ServerState, counted: Usage) -> dict[str, int]:
    """OpenAI's `usage` of an answer (usage.py), its completion tokens counted in the metrics."""
    out = usage(counted)
    state.metrics.completion_tokens += out["completion_tokens"]
    return out


def _id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


class _Chunks:
    """chat.completion.chunk objects of one response (one id and creation time)."""

    def __init__(self, state: ServerState, body: ChatRequest) -> None:
        self.id, self.created, self.model = _id(), int(time.time()), state.config.model_name
        self.include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return self._object([choice])

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._object([]), "usage": usage}

    def _object(self, choices: list) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }


async def _chat_events(state: ServerState, body: ChatRequest, chunks: Any) -> AsyncIterator[str]:
    frames = _Chunks(state, body)
    try:
        yield sse(frames.chunk({"role": "assistant", "content": ""}))
        async for chunk in chunks:
            if chunk:
                yield sse(frames.chunk({"content": chunk}))
        counted = chunks.usage
        out = _usage(state, counted)
        yield sse(frames.chunk({}, finish_reason(counted)))
        if frames.include_usage:
            yield sse(frames.usage(out))
        yield sse("[DONE]")
    except Exception as error:  # after the 200 went out, an error can only be an event
        yield sse(error_event(error))
    finally:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()  # a disconnect or an error: cancel the generation


def _one_chunk_stream(state: ServerState, body: ChatRequest, text: str, counted: Usage) -> EventStream:
    frames = _Chunks(state, body)
    out = _usage(state, counted)

    async def lines() -> AsyncIterator[str]:
        yield sse(frames.chunk({"role": "assistant", "content": text}))
        yield sse(frames.chunk({}, finish_reason(counted)))
        if frames.include_usage:
            yield sse(frames.usage(out))
        yield sse("[DONE]")

    return EventStream(lines())
