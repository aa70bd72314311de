"""The async skills' streams are submitted to the engine before they are returned, as the sync ones
are: a request the engine refuses (max_tokens or a prompt beyond the context) raises at the call,
not at the stream's first read (the server then answers it 400 before any event), and a stream
closed before its first read still frees its place in the engine."""

from __future__ import annotations

import asyncio

import pytest

from foveal.engine import FinishReason
from tests.sdk.conftest import scene_image

TOO_LONG = {"max_tokens": 8000}


def all_pages_free(model) -> bool:
    return model.engine.wait_idle(10) and model.engine.free_pages() == model.engine.config.num_pages


@pytest.mark.parametrize(
    "call",
    [
        lambda m, im: m.acaption(im, stream=True, settings=TOO_LONG),
        lambda m, im: m.aquery(im, "how many?", stream=True, settings=TOO_LONG),
    ],
    ids=["acaption", "aquery"],
)
def test_an_async_stream_that_cannot_fit_raises_at_the_call(shapes_model, call):
    async def started():
        return await call(shapes_model, scene_image())

    with pytest.raises(ValueError, match="does not fit"):
        asyncio.run(started())  # before: a result, whose first read raised
    assert all_pages_free(shapes_model)


def test_an_async_chat_stream_that_cannot_fit_raises_at_the_call(llama_model):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="does not fit"):
        llama_model.chat(messages, settings=TOO_LONG, stream=True)  # the sync twin, as it was
    with pytest.raises(ValueError, match="does not fit"):
        asyncio.run(llama_model.achat(messages, settings=TOO_LONG, stream=True))
    assert all_pages_free(llama_model)


def test_an_async_stream_closed_before_its_first_read_frees_its_request(shapes_model, llama_model):
    async def closed_unread():
        caption = await shapes_model.acaption(scene_image(), stream=True, settings={"max_tokens": 200})
        chat = await llama_model.achat([{"role": "user", "content": "hi"}], settings={"max_tokens": 400}, stream=True)
        await caption["caption"].aclose()
        await chat["text"].aclose()

    asyncio.run(closed_unread())
    assert all_pages_free(shapes_model) and all_pages_free(llama_model)


def test_an_async_stream_reads_as_before(shapes_model):
    async def read() -> tuple[str, object]:
        result = await shapes_model.acaption(scene_image(), stream=True, settings={"max_tokens": 6, "temperature": 0.0})
        text = "".join([chunk async for chunk in result["caption"]])
        return text, result["caption"].usage

    text, usage = asyncio.run(read())
    plain = shapes_model.caption(scene_image(), settings={"max_tokens": 6, "temperature": 0.0})
    assert text == plain["caption"] and usage is not None


def test_a_stream_closed_before_its_first_read_frees_its_request(shapes_model, llama_model):
    caption = shapes_model.caption(scene_image(), stream=True, settings={"max_tokens": 200})
    chat = llama_model.chat([{"role": "user", "content": "hi"}], settings={"max_tokens": 400}, stream=True)
    for stream in (caption["caption"], chat["text"]):
        stream.close()
        # the request itself was stopped, not left to run to its max_tokens
        assert stream._chunks._handle.result().finish_reason is FinishReason.CANCELLED
    assert all_pages_free(shapes_model) and all_pages_free(llama_model)
