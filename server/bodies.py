"""`JsonRoute`: the routes' JSON bodies parsed before FastAPI validates them, bounded, off the event
loop when large, and checked for text that is not Unicode.

PROBLEM
    FastAPI parses a JSON body with one `json.loads` on the event loop, then validates it there. A
    body within the size limit (16 MB) can still hold millions of values (a 500,000-point
    `spatial_refs` array: 6 MB, a long parse and a longer validation), and every other
    request, /health included, waits for it. A string with a lone UTF-16 surrogate (`"\\ud800"`) is
    valid JSON but no text: it reached the tokenizer, whose message ("TextEncodeInput must be
    Union[...]") tells an HTTP client nothing.
    Values the number hooks cannot see are cheap to send and dear to parse: 16 MB of `[[],[],...]`
    is 5.6 million lists, which one `json.loads` (a C call: the GIL held throughout, in a worker
    thread too) builds for seconds; `[null,...]`, `[{},...]` and `["",...]` the same, less.
SOLUTION
    `JsonRoute` parses the body itself and hands FastAPI the parsed value (`_Parsed.json()`). A body
    over INLINE_BYTES is parsed in a worker thread. First its structural bytes (`[`, `{`, `,` and
    `:`, which every value but the first follows) are counted, a slice of the body at a time (each
    `bytes.count` a fraction of a millisecond, so the GIL goes back to the loop between them): past
    MAX_STRUCTURE the body is refused (413) unparsed. The bound is loose (MAX_VALUES times 5: the
    bytes in texts count too, so a long text with commas passes), and it keeps what one
    `json.loads` builds to milliseconds (docs/performance.md has the figures). Then the parse, with hooks on its numbers that count them (past
    MAX_VALUES the parse stops: a 413) and, being Python calls, let the thread hand the GIL back to
    the loop while it parses. Then every value is visited once (at most MAX_VALUES of them) and every
    string checked for lone surrogates: a 400 naming where it is. Bad JSON is the 400 `invalid_json`
    FastAPI's own parse gave.
INVARIANTS
    - No body over INLINE_BYTES is parsed or walked on the event loop.
    - No body with more than MAX_STRUCTURE structural bytes is parsed.
    - Work on a body with too many values stops after MAX_VALUES of them.
    - A route sees only bodies whose every string is valid Unicode.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from foveal.server.errors import NOT_JSON, ApiError

INLINE_BYTES = 16 * 1024  # parsed and walked on the loop below this: about a millisecond at most
# JSON values of one body (numbers, strings, arrays, ...), far above any real request. Low enough
# that a refused body leaves few objects behind: 100,000 numbers left 50,000 lists whose promotion
# set off a full garbage collection of the process (GIL held; server/heap.py) in a server with a model loaded.
MAX_VALUES = 20_000
# Structural bytes ([ { , :) of one body: every value but the first follows one, so this bounds the
# values a parse builds. Loose (texts' commas count), and low enough that a parse stays short.
MAX_STRUCTURE = 5 * MAX_VALUES
STRUCTURE = (b"[", b"{", b",", b":")
SLICE_BYTES = 256 * 1024  # counted per bytes.count call: well under a millisecond


class JsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed_first(request: Request) -> Response:
            if _is_json(request):
                body = await request.body()
                if body:
                    request = _Parsed(request, body, await parse_body(body))
            return await handler(request)

        return parsed_first


class _Parsed(Request):
    """The request with its body already read and parsed (what FastAPI reads through `json()`)."""

    def __init__(self, request: Request, body: bytes, value: Any) -> None:
        super().__init__(request.scope, request.receive)  # later receive() calls: the client's
        self._raw, self._value = body, value

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._value


def _is_json(request: Request) -> bool:
    """Whether FastAPI would parse this body as JSON (its strict content-type rule)."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def parse_body(body: bytes) -> Any:
    """The body's JSON value, checked (module docstring); ApiError 400 or 413 otherwise."""
    if len(body) <= INLINE_BYTES:
        return _parse(body, json.loads)
    return await asyncio.to_thread(_parse_large, body)


def _parse_large(body: bytes) -> Any:
    if _structure_over(body, MAX_STRUCTURE):
        raise ApiError(
            413,
            f"the request body holds more than {MAX_STRUCTURE} of JSON's structural characters ('[', '{{', "
            "',', ':', in texts too), this server's limit; send fewer values (spatial_refs, messages, ...) "
            "per request",
            "request_too_large",
        )
    return _parse(body, _counted_loads)


def _structure_over(body: bytes, limit: int) -> bool:
    """Whether `body` holds more than `limit` structural bytes, counted a slice at a time (each count
    holds the GIL well under a millisecond), stopping once past the limit."""
    seen = 0
    for start in range(0, len(body), SLICE_BYTES):
        end = start + SLICE_BYTES
        for byte in STRUCTURE:
            seen += body.count(byte, start, end)
        if seen > limit:
            return True
    return False


def _parse(body: bytes, loads: Callable[[bytes], Any]) -> Any:
    try:
        value = loads(body)
    except _TooMany:
        raise _too_many() from None
    except (ValueError, RecursionError):  # JSONDecodeError, bad UTF-8, an int of 4300+ digits, deep nesting
        raise ApiError(400, NOT_JSON, "invalid_json") from None
    _check_values(value)
    return value


class _TooMany(Exception):
    pass


def _counted_loads(body: bytes) -> Any:
    """json.loads whose numbers are counted (and converted as json.loads does)."""
    seen = 0

    def number(convert: Callable[[str], Any]) -> Callable[[str], Any]:
        def counted(text: str) -> Any:
            nonlocal seen
            seen += 1
            if seen > MAX_VALUES:
                raise _TooMany
            return convert(text)

        return counted

    return json.loads(body, parse_float=number(float), parse_int=number(int))


def _too_many() -> ApiError:
    return ApiError(
        413,
        f"the request body holds more than {MAX_VALUES} JSON values, this server's limit; send fewer "
        "(spatial_refs, messages, ...) per request",
        "request_too_large",
    )


def _check_values(value: Any) -> None:
    """Count the values (MAX_VALUES) and refuse a string with a lone surrogate, naming its place."""
    stack: list[tuple[Any, str]] = [(value, "")]
    seen = 0
    while stack:
        item, where = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise _too_many()
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, dict):
            for key, inner in item.items():
                _check_text(key, where)
                stack.append((inner, f"{where}.{key}" if where else key))
        elif isinstance(item, list):
            stack.extend((inner, f"{where}[{i}]") for i, inner in enumerate(item))


def _check_text(text: str, where: str) -> None:
    if text.isascii():  # O(1) in CPython: most strings (base64 images) stop here
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        place = where or "body"
        raise ApiError(
            400,
            f"{place}: the text holds a lone UTF-16 surrogate (\\u{code:04x} at character {error.start}), "
            "which is not a character; send valid Unicode (a character above U+FFFF is a surrogate pair, "
            "high then low)",
            param=where or None,
        ) from None
