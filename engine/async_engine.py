"""An asyncio face for `Engine`: await results and iterate text deltas without blocking the loop.

The engine thread hands each delta to the event loop with `call_soon_threadsafe`; nothing here
polls or parks a thread per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from .engine import Engine
from .request import Request, RequestHandle, RequestOutput


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def submit(self, request: Request) -> RequestHandle:
        return self.engine.submit(request)

    async def generate(self, request: Request) -> RequestOutput:
        return await self.finished(self.engine.submit(request))

    @staticmethod
    async def finished(handle: RequestHandle) -> RequestOutput:
        """The output of a submitted request, awaited; a cancelled await cancels the request."""
        try:
            async for _ in AsyncEngine.deltas(handle):
                pass
        except asyncio.CancelledError:
            handle.cancel()
            raise
        return handle.result()

    async def stream(self, request: Request) -> AsyncIterator[str]:
        """Text deltas of a new request; closing the iterator early cancels the request."""
        handle = self.engine.submit(request)
        try:
            async for delta in self.deltas(handle):
                yield delta
        finally:
            handle.cancel()

    @staticmethod
    async def deltas(handle: RequestHandle) -> AsyncIterator[str]:
        """Text deltas of a submitted request until it finishes (then `handle.result()` is ready)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()

        def listen(d: str | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, d)

        for text in handle._subscribe(listen):
            queue.put_nowait(text)
        while (delta := await queue.get()) is not None:
            yield delta
