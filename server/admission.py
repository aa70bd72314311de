"""Admission and disconnects: how many model calls run at once, and what a client's leaving cancels.

PROBLEM
    The engine queues every request it is given, so a burst of clients could pile up unbounded work
    whose answers arrive after the clients gave up. And a client that disconnects (a closed tab, a
    timeout) must not leave its request decoding: its KV pages belong to the clients still waiting.
SOLUTION
    `Admission.slot()` counts model calls in flight, from before the image is decoded to the end of
    the answer (or stream); past `max_queue` a request is refused at once with 429 and Retry-After.
    `cancel_on_disconnect` runs a model call beside a task that waits for the client's
    `http.disconnect`; whichever ends first wins, and a disconnect cancels the call, which cancels
    its engine request (the SDK's async twins cancel their handle when their task is cancelled).
    Streams are cancelled by the response (streaming.py).
INVARIANTS
    - metrics.in_flight is the number of admitted calls, back to 0 when the server is idle.
    - A disconnected client's request ends CANCELLED in the engine and its pages are freed.
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


async def cancel_on_disconnect(request: Request, call: Awaitable[T], metrics: Metrics) -> T:
    """The result of `call`, or ClientGone (after cancelling `call`) when the client disconnects first."""
    work = asyncio.ensure_future(call)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (server shutdown)
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
    if work.cancelled():
        metrics.disconnects += 1
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
