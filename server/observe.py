"""`Observe`: ASGI middleware that counts and logs every request with its latency.

Pure ASGI so that a streamed response is timed to its last byte (and a stream the client left is
still counted, with status 499, nginx's "client closed request"). The route label is the matched
route's path template, or "other" for unknown paths, so a scan of random URLs cannot grow the
metrics without bound. One log line per request on the `foveal.server` logger.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from foveal.server.metrics import Metrics

log = logging.getLogger("foveal.server")
CLIENT_CLOSED = 499


class Observe:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = CLIENT_CLOSED  # until a response starts
        finished = False

        async def watched(message: Message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            final = status if finished else CLIENT_CLOSED
            seconds = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.observe(route, final, seconds)
            log.info("%s %s %d %.1f ms", scope["method"], scope["path"], final, seconds * 1000)
