"""Server-Sent Events that stop generating when the client leaves, and end with an error event when
the server stops.

PROBLEM
    A streamed caption decodes for as long as its client reads. If the client disconnects, the
    generation must stop at once, not at the next chunk's failed write (on a slow model that may be
    seconds away), and its engine request must be cancelled so its KV pages come back. If the server
    stops while the stream runs, the client must learn that its answer was cut, not see the
    connection drop after a 200.
SOLUTION
    `EventStream` runs the body beside a task that waits for `http.disconnect`, on every ASGI
    version (Starlette only does so below ASGI 2.4), and one that waits for `stop` (set when the
    shutdown grace is over, run.py). A disconnect or `stop` cancels the body's task group, which
    closes the event generator, whose `finally` closes the SDK stream (shielded from the
    cancellation), which cancels the engine request. After `stop` the stream then sends its `final`
    lines (an error event and `data: [DONE]`, state.py) and ends. `events()` turns an SDK text
    stream into SSE lines and owns that close. What the engine refuses at submit (max_tokens or a
    prompt beyond the context) is a status, not an error event: the SDK's async skills submit
    before they return the stream, inside the route's call, before the 200 goes out.
INVARIANTS
    - The body iterator is closed however the stream ended; `on_close` runs once, last, after the
      final lines were sent (admission counts the stream until then).
    - After `stop`, a stream that had not ended sends `final` and then the end of its body, never a
      second end.
    - A stream is closed only once nothing iterates it (a stream a task is inside refuses aclose).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> str:
    """One SSE event; dicts as compact JSON, strings as they are (OpenAI's `[DONE]`)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


class EventStream(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None] | None = None,
        stop: asyncio.Event | None = None,
        final: Sequence[str] = (),
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close  # called once the stream ended, however it ended
        self.stop = stop
        self.final = final  # sent when `stop` cut the stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = _Sent(send)
        try:
            if await self._run(sent, receive) and not sent.complete:
                await self._send_final(sent)
        finally:
            if self.on_close is not None:
                self.on_close()

    async def _run(self, send: Send, receive: Receive) -> bool:
        """Stream the body until it ends, the client leaves or `stop` is set; True for `stop`."""
        stopped = False
        try:
            async with anyio.create_task_group() as group:

                async def body() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def halt(stop: asyncio.Event) -> None:
                    nonlocal stopped
                    await stop.wait()
                    stopped = True
                    group.cancel_scope.cancel()

                group.start_soon(body)
                if self.stop is not None:
                    group.start_soon(halt, self.stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                with anyio.CancelScope(shield=True):
                    await closer()
        return stopped

    async def _send_final(self, sent: _Sent) -> None:
        if not sent.started:
            await sent(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
        with contextlib.suppress(OSError):
            for line in self.final:
                await sent({"type": "http.response.body", "body": line.encode(), "more_body": True})
            await sent({"type": "http.response.body", "body": b"", "more_body": False})


class _Sent:
    """An ASGI `send` that remembers whether the response started and whether its body ended."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False
        self.complete = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self.send(message)


async def events(
    chunks: AsyncIterator[Any],
    frame: Callable[[Any], Any],
    done: Sequence[Any] | Callable[[], Sequence[Any]],
    on_error: Callable[[BaseException], Any],
) -> AsyncIterator[str]:
    """SSE lines: `frame(chunk)` per chunk (text, or a stream's update dicts), then each of `done`
    (or of `done()`, made once the chunks ended: what only the end knows, such as the usage); an
    error mid-stream becomes one `on_error(exc)` event (the status line is already sent). Closing
    this closes `chunks`."""
    try:
        async for chunk in chunks:
            if chunk:
                yield sse(frame(chunk))
        for item in done() if callable(done) else done:
            yield sse(item)
    except Exception as error:  # after the 200 went out, an error can only be an event
        yield sse(on_error(error))
    finally:
        closer = getattr(chunks, "aclose", None)
        if closer is not None:
            with anyio.CancelScope(shield=True):
                await closer()
