"""Server-Sent Events that stop generating when the client leaves.

PROBLEM
    A streamed caption decodes for as long as its client reads. If the client disconnects, the
    generation must stop at once, not at the next chunk's failed write (on a slow model that may be
    seconds away), and its engine request must be cancelled so its KV pages come back.
SOLUTION
    `EventStream` runs the body beside a task that waits for `http.disconnect`, on every ASGI
    version (Starlette only does so below ASGI 2.4); a disconnect cancels the body's task group,
    which closes the event generator, whose `finally` closes the SDK stream (shielded from the
    cancellation), which cancels the engine request. `events()` turns an SDK text stream into SSE
    lines and owns that close.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> str:
    """One SSE event; dicts as compact JSON, strings as they are (OpenAI's `[DONE]`)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


class EventStream(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close  # called once the stream ended, however it ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def body() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(body)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                with anyio.CancelScope(shield=True):
                    await closer()
            if self.on_close is not None:
                self.on_close()


async def events(
    chunks: AsyncIterator[str],
    frame: Callable[[str], Any],
    done: list[Any],
    on_error: Callable[[BaseException], Any],
) -> AsyncIterator[str]:
    """SSE lines: `frame(chunk)` per text chunk, then each of `done`; an error mid-stream becomes
    one `on_error(exc)` event (the status line is already sent). Closing this closes `chunks`."""
    try:
        async for chunk in chunks:
            if chunk:
                yield sse(frame(chunk))
        for item in done:
            yield sse(item)
    except Exception as error:  # after the 200 went out, an error can only be an event
        yield sse(on_error(error))
    finally:
        closer = getattr(chunks, "aclose", None)
        if closer is not None:
            with anyio.CancelScope(shield=True):
                await closer()
