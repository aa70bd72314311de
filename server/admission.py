"""Admission and disconnects: how many model calls run at once, and what a client's leaving (or the
server's stopping) cancels.

PROBLEM
    The engine queues every request it is given, so a burst of clients could pile up unbounded work
    whose answers arrive after the clients gave up. And a client that disconnects (a closed tab, a
    timeout) must not leave its request decoding: its KV pages belong to the clients still waiting.
    A server that stops must answer the calls it cannot finish, not drop them.
SOLUTION
    `Admission.slot()` counts model calls in flight, from before the image is decoded to the end of
    the answer (or stream); past `max_queue` a request is refused at once with 429 and Retry-After.
    `cancel_on_disconnect` runs a model call beside a task that waits for the client's
    `http.disconnect` and one that waits for `stop` (set when the shutdown grace is over, run.py);
    whichever ends first wins. A disconnect cancels the call, which cancels its engine request (the
    SDK's async twins cancel their handle when their task is cancelled); `stop` cancels it the same
    way and answers 503 `shutting_down`. Streams are cancelled by the response (streaming.py).
INVARIANTS
    - metrics.in_flight is the number of admitted calls, back to 0 when the server is idle.
    - A disconnected client's request ends CANCELLED in the engine and its pages are freed.
    - A call cut by the shutdown is answered 503 in errors.py's body, never left to the ASGI
      server's cancellation (a 500 and a traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from foveal.server.errors import ApiError
from foveal.server.metrics import Metrics

T = TypeVar("T")
RETRY_AFTER_S = 1


class ClientGone(Exception):
    """The client disconnected before its answer; there is no one to answer."""


def shutting_down(detail: str) -> ApiError:
    """The 503 of a call the stopping server refuses or cuts; `detail` says which."""
    return ApiError(
        503,
        f"the server is shutting down: {detail}; send it again once the server is back (GET /health "
        "says 'ok'), or to another instance",
        "shutting_down",
        headers={"Retry-After": "5", "Connection": "close"},
    )


class Admission:
    def __init__(self, max_queue: int, metrics: Metrics) -> None:
        self.max_queue = max_queue
        self.metrics = metrics

    def admit(self) -> None:
        """Count one more call in flight, or raise 429 when --max-queue are already; `release()` after."""
        if self.metrics.in_flight >= self.max_queue:
            self.metrics.rejected_queue_full += 1
            raise ApiError(
                429,
                f"the server has {self.max_queue} calls in flight, its --max-queue; retry after "
                f"{RETRY_AFTER_S} s",
                "queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.metrics.in_flight += 1

    def release(self) -> None:
        self.metrics.in_flight -= 1

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        self.admit()
        try:
            yield
        finally:
            self.release()


async def cancel_on_disconnect(
    request: Request, call: Awaitable[T], metrics: Metrics, stop: asyncio.Event | None = None
) -> T:
    """The result of `call`; ClientGone when the client disconnects first, the 503 of `shutting_down`
    when `stop` is set first (either after cancelling `call`)."""
    work = asyncio.ensure_future(call)
    watchers = [asyncio.ensure_future(_disconnected(request))]
    if stop is not None:
        watchers.append(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait((work, *watchers), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled
        for watcher in watchers:
            watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
    if work.cancelled():
        if stop is not None and stop.is_set():
            raise shutting_down(
                "this call was still running when its shutdown grace ended, and was cancelled"
            )
        metrics.disconnects += 1
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
