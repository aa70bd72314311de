"""`Observe`: ASGI middleware that counts and logs every request with its latency, and answers the
exceptions nothing else did.

Pure ASGI so that a streamed response is timed to its last byte. The route label is the matched
route's path template, or "other" for unknown paths, so a scan of random URLs cannot grow the
metrics without bound. One log line per request on the `foveal.server` logger.

INVARIANTS
    - A response that never finished because its client left (a dropped stream, a body never
      sent) is counted with status 499, nginx's "client closed request", and as one client
      disconnect. A model call whose client left before its answer started is counted by
      admission.py and answered 499 in full, so it is not counted twice; a response the server
      cancelled (stopping) is a 499 but no disconnect.
    - An exception no handler took is answered 500 with the JSON error body of errors.py (its
      text stays out of the body), logged once with its traceback, and counted as 500. It does not
      reach the ASGI server, which would log it a second time.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from foveal.server.errors import INTERNAL_MESSAGE, ApiError
from foveal.server.gate import refuse
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
        outcome = "cancelled"  # until the app returns ("returned") or raises ("failed")

        async def watched(message: Message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
            outcome = "returned"
        except Exception:
            outcome = "failed"
            if status != CLIENT_CLOSED:
                raise  # mid-response: only the server can end the connection (and it logs why)
            log.exception("unexpected error in %s %s", scope["method"], scope["path"])
            await refuse(watched, ApiError(500, INTERNAL_MESSAGE, "internal_error"))
        finally:
            if finished:
                final = status
            elif outcome == "failed":
                final = 500
            else:  # the client left before the answer ended (or the server cancelled it, stopping)
                final = CLIENT_CLOSED
                if outcome == "returned":
                    self.metrics.disconnects += 1
            seconds = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.observe(route, final, seconds)
            log.info("%s %s %d %.1f ms", scope["method"], scope["path"], final, seconds * 1000)
