"""`Gate`: the ASGI middleware that checks the API key and the body size before any route runs.

PROBLEM
    A request with a wrong key, or a 2 GB body, must be refused before it costs anything: before
    its body is parsed as JSON, its image decoded or its model call admitted.
SOLUTION
    Pure ASGI (not Starlette's BaseHTTPMiddleware, which buffers streaming responses and hides
    client disconnects): for /v1 routes the key is compared in constant time (X-Moondream-Auth, or
    Authorization: Bearer: each client sends its own); the body is read here, at most
    `max_body_bytes` of it (a Content-Length over the limit is refused without reading), and
    replayed to the app, whose later `receive()` calls go on to the client's (so disconnects still
    reach the routes).
INVARIANTS
    - No /v1 route runs without the key when one is set: 401 otherwise.
    - No route sees a body over the limit: 413 with the limit in the message.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from foveal.server.errors import ApiError

PROTECTED = "/v1/"


class Gate:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key and scope["path"].startswith(PROTECTED) and not self._authorized(scope):
            await refuse(
                send,
                ApiError(
                    401,
                    "missing or wrong API key; send it as 'X-Moondream-Auth: KEY' or "
                    "'Authorization: Bearer KEY'",
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                ),
            )
            return
        if _content_length(scope) > self.max_body_bytes:
            await self._too_large(send)
            return
        body, complete, gone = await self._read_body(receive)
        if gone:
            return  # the client left before sending its body: nothing to answer
        if not complete:
            await self._too_large(send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"x-moondream-auth")
        if given is None:
            bearer = headers.get(b"authorization", b"")
            given = bearer[7:].strip() if bearer[:7].lower() == b"bearer " else None
        return given is not None and hmac.compare_digest(given, self.api_key)

    async def _read_body(self, receive: Receive) -> tuple[bytes, bool, bool]:
        """(body, whether it fit the limit, whether the client disconnected)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", False, True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", False, False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True, False

    async def _too_large(self, send: Send) -> None:
        await refuse(
            send,
            ApiError(
                413,
                f"the request body is over this server's limit of {self.max_body_bytes} bytes; send a "
                "smaller image (or start the server with a larger --max-body-bytes)",
                "request_too_large",
            ),
        )


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's own messages (http.disconnect)

    return replayed


async def refuse(send: Send, error: ApiError) -> None:
    """Answer `error` straight on the ASGI channel (no route, no response object, before any body)."""
    payload = json.dumps(error.body()).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
