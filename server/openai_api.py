"""OpenAI's chat API: `POST /v1/chat/completions` and `GET /v1/models`, as the `openai` client sends them.

chat.py turns the request into one Model call. Text answers (`query`) are always decoded as a
stream inside the server, so that a `stop` string cancels the generation where it appears and a
streamed response forwards each chunk as it comes. JSON answers (`generate` under the schema's
grammar) come whole; streamed, they are sent as one content chunk. An answer cut by max_tokens is
OpenAI's `finish_reason: "length"` with the text so far, not an error (the openai client's
`parse()` then raises its LengthFinishReasonError). `usage` is the engine's own count (usage.py;
estimated only where the server cut the answer at a stop string). Streams: `chat.completion.chunk` objects, a last chunk with `finish_reason`, a
usage chunk when `stream_options.include_usage`, then `data: [DONE]`.
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
from foveal.server.admission import cancel_on_disconnect
from foveal.server.chat import ChatCall, ChatRequest, chat_call
from foveal.server.errors import api_error, error_body
from foveal.server.state import ServerState, state_of
from foveal.server.stops import StopCutter
from foveal.server.streaming import EventStream, sse
from foveal.server.usage import finish_reason

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
    model = state.ready_model()
    state.admission.admit()
    released = False
    try:
        if plan.skill == "generate":
            text, counted = await cancel_on_disconnect(request, _generate(model, plan), state.metrics)
            cut_at_stop = False
            if body.stream:  # the answer is whole: its slot is released here, not by the stream
                return _one_chunk_stream(state, body, plan, text, counted)
        else:
            result = await cancel_on_disconnect(
                request, model.aquery(plan.image, plan.prompt, True, plan.settings), state.metrics
            )
            if body.stream:
                released = True
                lines = _chat_events(state, body, plan, result["answer"])
                return EventStream(lines, on_close=state.admission.release)
            text, cut_at_stop = await cancel_on_disconnect(
                request, _collect(result["answer"], plan), state.metrics
            )
            counted = result["answer"].usage  # None when the server cut the answer at a stop string
    finally:
        if not released:
            state.admission.release()
    usage = state.tokens.usage(counted, plan.prompt, plan.image is not None, text)
    state.metrics.completion_tokens += usage["completion_tokens"]
    return {
        "id": _id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.config.model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "finish_reason": finish_reason(cut_at_stop, counted),
                "logprobs": None,
            }
        ],
        "usage": usage,
    }


async def _generate(model: Any, plan: ChatCall) -> tuple[str, Usage | None]:
    try:
        result = await model.agenerate(plan.image, plan.prompt, plan.output_type, plan.settings)
    except IncompleteOutputError as cut:  # OpenAI's finish_reason "length", with the text so far
        return cut.text, cut.usage
    return result["text"], result.usage


async def _collect(chunks: Any, plan: ChatCall) -> tuple[str, bool]:
    """The whole text of a streamed answer, cut at the first stop string (which cancels the rest);
    and whether it was cut there."""
    cutter = StopCutter(plan.stops)
    parts: list[str] = []
    try:
        async for chunk in chunks:
            parts.append(cutter.feed(chunk))
            if cutter.stopped:
                return "".join(parts), True
    finally:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()  # after a stop: cancels the generation
    return "".join(parts) + cutter.flush(), False


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


async def _chat_events(
    state: ServerState, body: ChatRequest, plan: ChatCall, chunks: Any
) -> AsyncIterator[str]:
    frames = _Chunks(state, body)
    cutter = StopCutter(plan.stops)
    sent: list[str] = []
    try:
        yield sse(frames.chunk({"role": "assistant", "content": ""}))
        async for chunk in chunks:
            text = cutter.feed(chunk)
            if text:
                sent.append(text)
                yield sse(frames.chunk({"content": text}))
            if cutter.stopped:
                break
        rest = cutter.flush() if not cutter.stopped else ""
        if rest:
            sent.append(rest)
            yield sse(frames.chunk({"content": rest}))
        answer = "".join(sent)
        counted = None if cutter.stopped else chunks.usage
        usage = state.tokens.usage(counted, plan.prompt, plan.image is not None, answer)
        state.metrics.completion_tokens += usage["completion_tokens"]
        finish = finish_reason(cutter.stopped, counted)
        yield sse(frames.chunk({}, finish))
        if frames.include_usage:
            yield sse(frames.usage(usage))
        yield sse("[DONE]")
    except Exception as error:  # after the 200 went out, an error can only be an event
        problem = api_error(error)
        yield sse(error_body(problem.message, problem.type))
    finally:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()  # a stop, a disconnect or an error: cancel the generation


def _one_chunk_stream(
    state: ServerState, body: ChatRequest, plan: ChatCall, text: str, counted: Usage | None
) -> EventStream:
    frames = _Chunks(state, body)
    usage = state.tokens.usage(counted, plan.prompt, plan.image is not None, text)
    state.metrics.completion_tokens += usage["completion_tokens"]

    async def lines() -> AsyncIterator[str]:
        yield sse(frames.chunk({"role": "assistant", "content": text}))
        yield sse(frames.chunk({}, finish_reason(False, counted)))
        if frames.include_usage:
            yield sse(frames.usage(usage))
        yield sse("[DONE]")

    return EventStream(lines())
