"""`relay()`: one HTTP request run through an ASGI app in this process, its response given back as
pieces that can cross a Ray call: the bridge between the ingress and a replica's foveal app.

PROBLEM
    A replica runs the very app `foveal serve` runs (app.py: routes, Gate, Observe, admission,
    errors), but its requests come from the ingress as Ray calls, not over a socket, and answers
    may stream (Server-Sent Events) for as long as a caption takes.
SOLUTION
    The ingress sends a `Forwarded` (method, path, query, headers, body); `relay` builds the ASGI
    scope, gives the app the body and then waits for a disconnect, and yields the response: first
    a `Head` (status, headers, the first body chunk, whether more follows), then each further body
    chunk as bytes. A non-streamed answer is therefore one item, so the ingress never starts an
    answer whose body a dying replica could still lose.
INVARIANTS
    - The app sees `http.disconnect` once the consumer stops (the ingress cancelled the call: its
      client left, or the shutdown cut it), so the route cancels its engine request, as it does
      for a client that leaves `foveal serve`.
    - The app's task is never left running: it gets DISCONNECT_GRACE_S to finish after the
      disconnect, then is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message

DISCONNECT_GRACE_S = 5.0
REPLICA_HEADER = "x-foveal-replica"  # every answer names the replica that gave it
_DONE = object()


@dataclass(slots=True)
class Forwarded:
    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass(slots=True)
class Head:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    more: bool


def scope_of(request: Forwarded) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": request.client,
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def relay(app: ASGIApp, request: Forwarded, replica: str) -> AsyncIterator[Head | bytes]:
    """The app's answer to `request` (the module docstring), its head naming `replica`."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        messages.put_nowait(message)

    task = asyncio.ensure_future(app(scope_of(request), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(_DONE))
    start: Message | None = None
    try:
        while (message := await messages.get()) is not _DONE:
            if message["type"] == "http.response.start":
                start = message
                continue
            if message["type"] != "http.response.body":
                continue
            chunk, more = message.get("body", b""), message.get("more_body", False)
            if start is not None:
                headers = [*start.get("headers", []), (REPLICA_HEADER.encode(), replica.encode())]
                yield Head(start["status"], headers, chunk, more)
                start = None
            elif chunk:
                yield chunk
            if not more:
                break
        failure = task.exception() if task.done() and not task.cancelled() else None
        if failure is not None:
            raise failure
    finally:
        gone.set()
        await _settle(task)


async def _settle(task: asyncio.Future) -> None:
    """Let the app finish after the disconnect (its route cancels its engine request), then stop it."""
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
