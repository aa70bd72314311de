"""OpenAI's chat API: `POST /v1/chat/completions` and `GET /v1/models`, as the `openai` client sends them.

chat.py turns the request into `Model.chat` calls (one per choice, `n`), the conversation passed
through as it came. Every answer streams from the engine when asked (`stream`): free text, JSON
under the schema's grammar, thinking and tool calls alike (a `stop` string ends free text where it
appears, in the engine). The reply is read back by `foveal.tools.ReplyReader`: the thinking goes out
as `reasoning_content`, the answer as `content`, each tool call as `tool_calls` (finish_reason
"tool_calls"); streamed, a call goes out as OpenAI's deltas: its index, id, type and name first, then
pieces of its arguments' JSON text (as the model writes them in Qwen's format; whole, once the reply
is complete, in foveal's JSON format). An answer cut by max_tokens is OpenAI's
`finish_reason: "length"` with what was written so far, not an error (the openai client's `parse()`
then raises its LengthFinishReasonError). `usage` is the engine's own count (usage.py), the prompt
counted once for all choices. Streams: `chat.completion.chunk` objects (each with its choice's
index), a last chunk per choice with `finish_reason`, a usage chunk when
`stream_options.include_usage`, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter, Request

from foveal import tools as chat_tools
from foveal.errors import IncompleteOutputError
from foveal.results import Usage
from foveal.server.bodies import JsonRoute
from foveal.server.chat import ChatCall, ChatRequest, chat_call
from foveal.server.errors import ApiError, error_event
from foveal.server.measure import check_fits
from foveal.server.state import ServerState, call, state_of, stream_call
from foveal.server.streaming import sse
from foveal.server.usage import finish_reason, usage

router = APIRouter(prefix="/v1", tags=["openai"], route_class=JsonRoute)  # bodies: bodies.py


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    entry = {"id": state.config.model_name, "object": "model", "created": 0, "owned_by": "foveal"}
    return {"object": "list", "data": [entry]}


@router.post("/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Any:
    plan = await asyncio.to_thread(chat_call, body)  # images decoded, tools compiled: off the loop
    state = state_of(request)
    await check_fits(state.ready_model(), plan.texts())
    if body.stream:
        return await stream_call(
            request,
            lambda m: _start_streams(m, plan),
            lambda streams: _chat_events(state, body, plan, streams),
        )
    answers = await call(request, lambda m: _answers(m, plan))
    choices = [_choice(i, answer, plan) for i, answer in enumerate(answers)]
    return {
        "id": _id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.config.model_name,
        "choices": choices,
        "usage": _usage(state, [counted for _, counted in answers]),
    }


# ---- whole answers ----------------------------------------------------------------------------------------------


async def _answers(model: Any, plan: ChatCall) -> list[tuple[Any, Usage]]:
    """(the result, or the reply read before the cut, and its usage) of each choice."""
    return list(await asyncio.gather(*(_answer(model, plan, i) for i in range(plan.n))))


async def _answer(model: Any, plan: ChatCall, index: int) -> tuple[Any, Usage]:
    if _grounded(model, plan):
        image, question = plan.question()
        result = await model.aquery(image, question, settings=plan.choice_settings(index), reasoning=True)
        reasoning = result.get("reasoning") or {}
        reply = {"text": result["answer"], "reasoning": reasoning.get("text"), "grounding": reasoning.get("grounding")}
        return reply, result.usage
    args, extra = plan.args(index)
    try:
        result = await model.achat(*args, **extra)
    except IncompleteOutputError as cut:  # OpenAI's finish_reason "length", with the text so far
        return getattr(cut, "reply", None) or chat_tools.Reply(text=cut.text), cut.usage
    return result, result.usage


def _choice(index: int, answer: tuple[Any, Usage], plan: ChatCall) -> dict[str, Any]:
    result, counted = answer
    if isinstance(result, chat_tools.Reply):  # cut by max_tokens
        text, reasoning, calls, logprobs = result.text, result.reasoning, result.tool_calls, None
    else:
        text, reasoning, calls = result["text"], result.get("reasoning"), result.get("tool_calls") or []
        logprobs = result.get("logprobs")
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if calls:
        message["content"] = text or None
        message["tool_calls"] = [_tool_call(call) for call in calls]
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    grounding = result.get("grounding") if isinstance(result, dict) else None
    if grounding is not None:  # the moondream client's fields of a grounded reasoning
        message["reasoning"] = reasoning
        message["reasoning_details"] = {"grounding": grounding}
    finish = "tool_calls" if calls and counted.finish_reason != "length" else finish_reason(counted)
    lp = {"content": logprobs or [], "refusal": None} if plan.logprobs is not None else None
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": lp}


def _grounded(model: Any, plan: ChatCall) -> bool:
    """Whether the call is a grounded reasoning (query(reasoning=True)); 400 where the model has none."""
    if not plan.reasoning:
        return False
    if model.capabilities.reasoning:
        return True
    if model.family.thinking is not None:
        return False  # its template's thinking section: returned as reasoning_content anyway
    raise ApiError(
        400,
        f"reasoning is not supported by this model ({model.family.name}): it has no grounded reasoning and "
        "its chat template no thinking section; leave reasoning out",
        param="reasoning",
    )


def _tool_call(call: dict) -> dict[str, Any]:
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": arguments}}


def _usage(state: ServerState, counted: list[Usage]) -> dict[str, int]:
    """OpenAI's `usage` of all choices (the prompt once), their completion tokens counted in the metrics."""
    total = Usage(counted[0].prompt_tokens, sum(c.completion_tokens for c in counted), counted[0].finish_reason)
    out = usage(total)
    state.metrics.completion_tokens += out["completion_tokens"]
    return out


def _id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


# ---- streams ----------------------------------------------------------------------------------------------------


async def _start_streams(model: Any, plan: ChatCall) -> list[Any]:
    """The choices' streams, started (each one's input checked, by the SDK and by the engine's
    submit, which the SDK does before it returns a stream: before the 200 goes out)."""
    streams: list[Any] = []
    grounded = _grounded(model, plan)
    question = plan.question() if grounded else None
    try:
        for index in range(plan.n):
            if question is not None:
                image, text = question
                settings = plan.choice_settings(index)
                result = await model.aquery(image, text, stream=True, settings=settings, reasoning=True)
                streams.append(_ReasonedStream(result["answer"], (result.get("reasoning") or {}).get("text")))
                continue
            args, extra = plan.args(index)
            result = await model.achat(*args, stream=True, **extra)
            streams.append(result["text"])
    except BaseException:
        for stream in streams:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        raise
    return streams


class _ReasonedStream:
    """A grounded reasoning's answer stream, its reasoning text (made before the answer) first."""

    def __init__(self, answer: Any, reasoning: str | None) -> None:
        self.answer, self.reasoning = answer, reasoning

    @property
    def usage(self) -> Any:
        return self.answer.usage

    def __aiter__(self) -> AsyncIterator[str]:
        return self.answer.__aiter__()

    async def aclose(self) -> None:
        await self.answer.aclose()


class _Chunks:
    """chat.completion.chunk objects of one response (one id and creation time)."""

    def __init__(self, state: ServerState, body: ChatRequest) -> None:
        self.id, self.created, self.model = _id(), int(time.time()), state.config.model_name
        self.include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(
        self, index: int, delta: dict[str, Any], finish: str | None = None, logprobs: list | None = None
    ) -> dict[str, Any]:
        lp = {"content": logprobs, "refusal": None} if logprobs is not None else None
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
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
    state: ServerState, body: ChatRequest, plan: ChatCall, streams: list[Any]
) -> AsyncIterator[str]:
    """The SSE lines of every choice's stream, merged in the order they come."""
    frames = _Chunks(state, body)
    counted: list[Usage] = [Usage(0, 0, "stop")] * len(streams)
    lines: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for line in _choice_events(frames, plan, index, streams[index], counted):
                await lines.put((index, line))
        finally:
            lines.put_nowait((index, None))  # ended, either way (an error is raised by task.result())

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        open_choices = len(streams)
        while open_choices:
            _, line = await lines.get()
            if line is None:
                open_choices -= 1
                continue
            yield line
        for task in tasks:
            task.result()  # an error in a choice's events
        out = _usage(state, counted)
        if frames.include_usage:
            yield sse(frames.usage(out))
        yield sse("[DONE]")
    except Exception as error:  # after the 200 went out, an error can only be an event
        yield sse(error_event(error))
    finally:
        # A disconnect, the shutdown or an error: cancel the generations. Each pump must have
        # stopped before its stream is closed: a stream a pump is still inside (its task only asked
        # to cancel) refuses aclose() ("asynchronous generator is already running"), which ended
        # the response with a traceback and a 500 instead of its final events.
        with anyio.CancelScope(shield=True):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for stream in streams:
                await stream.aclose()


async def _choice_events(
    frames: _Chunks, plan: ChatCall, index: int, stream: Any, counted: list[Usage]
) -> AsyncIterator[str]:
    """One choice's chunks: the role, then its reply as it is read (ReplyReader), then its finish."""
    reader = chat_tools.ReplyReader(getattr(stream, "plan", None) or chat_tools.ChatPlan())
    state = {"calls": 0, "logprobs": 0}
    yield sse(frames.chunk(index, {"role": "assistant", "content": ""}))
    reasoning = getattr(stream, "reasoning", None)  # a grounded reasoning's text (_ReasonedStream)
    if reasoning is not None:
        yield sse(frames.chunk(index, {"reasoning_content": reasoning}))
    try:
        async for chunk in stream:
            for line in _event_lines(frames, plan, index, stream, reader.feed(chunk), state):
                yield line
        counted[index] = stream.usage
    except IncompleteOutputError as cut:  # cut by max_tokens: what was written, then "length"
        counted[index] = cut.usage
    for line in _event_lines(frames, plan, index, stream, reader.finish(), state, last=True):
        yield line
    cut = counted[index].finish_reason == "length"
    finish = "tool_calls" if state["calls"] and not cut else finish_reason(counted[index])
    yield sse(frames.chunk(index, {}, finish))


def _event_lines(
    frames: _Chunks, plan: ChatCall, index: int, stream: Any, events: list, state: dict, last: bool = False
) -> list[str]:
    lines = []
    for kind, value in events:
        if kind in ("reasoning", "content"):
            delta = {"reasoning_content" if kind == "reasoning" else "content": value}
            lines.append(sse(frames.chunk(index, delta, logprobs=_new_logprobs(plan, stream, state))))
            continue
        if kind == "call_start":  # OpenAI's first delta of a call: its index, id, type and name
            state["calls"] += 1
            function = {"name": value["name"], "arguments": ""}
            head = {"index": state["calls"] - 1, "id": value["id"], "type": "function", "function": function}
            lines.append(sse(frames.chunk(index, {"tool_calls": [head]})))
        elif kind == "call_arguments":  # then pieces of its arguments' JSON text
            arguments = {"index": state["calls"] - 1, "function": {"arguments": value}}
            lp = _new_logprobs(plan, stream, state)
            lines.append(sse(frames.chunk(index, {"tool_calls": [arguments]}, logprobs=lp)))
    if last:
        rest = _new_logprobs(plan, stream, state)
        if rest:  # tokens whose text went out in no content chunk (markup, a held-back tail)
            lines.append(sse(frames.chunk(index, {}, logprobs=rest)))
    return lines


def _new_logprobs(plan: ChatCall, stream: Any, state: dict) -> list | None:
    """The logprobs committed since the last chunk that carried some (None when none were asked for)."""
    if plan.logprobs is None:
        return None
    new = stream.logprobs(state["logprobs"]) if hasattr(stream, "logprobs") else []
    state["logprobs"] += len(new)
    return new
