"""HTTP errors: one JSON body for every failure, the SDK's exceptions mapped to statuses, and every
message put in HTTP terms.

SHAPE
    Every error on every route (Moondream's, OpenAI's, foveal's, FastAPI's own 404, 405 and body
    errors, a refusal by the gate, an unexpected exception) answers OpenAI's error object:

        {"error": {"message": str, "type": str, "param": str | null, "code": str}}

    OpenAI's clients parse it (`openai.BadRequestError.message` shows ours); Moondream's client
    reads only the status, and the body is the same there. `type` is the class of the status, as
    OpenAI-compatible servers name it; `code` says which error it is:

        status  type                   code
        400     invalid_request_error  invalid_value (bad value or setting), invalid_json, invalid_image
        401     authentication_error   invalid_api_key
        404     invalid_request_error  not_found
        405     invalid_request_error  method_not_allowed
        413     invalid_request_error  request_too_large
        422     invalid_request_error  invalid_body (fails the body's schema), unsupported_schema,
                                       incomplete_output (a constrained answer cut by max_tokens)
        429     rate_limit_error       queue_full, image_budget_full
        500     server_error           generation_error (the engine failed), internal_error
        503     server_error           model_not_ready, model_closed

SDK EXCEPTIONS (`api_error`; their messages already say what to fix)
    foveal.grammars.SchemaError  422 unsupported_schema     IncompleteOutputError  422 incomplete_output
    foveal.vision.ImageError     400 invalid_image          ModelClosedError       503 model_closed
    other ValueError, TypeError  400 invalid_value          GenerationError        500 generation_error
    foveal.vision.PixelBudgetTimeout 429 image_budget_full (Retry-After: the model's decoded-pixel budget stayed full)
    anything else: 500 internal_error, with a neutral message; the exception and its traceback are
    logged once (observe.py, or `error_event` mid-stream), never put in a body.

MESSAGES (`http_message`, applied to every message a body carries)
    The SDK speaks Python ("pass image=...", "device='cpu'"); HTTP_TERMS rewrites such advice
    into what an HTTP client can do, in one table. Native text (a Rust panic, of llguidance or the
    tokenizer, with its backtrace and build paths) is cut to its first meaningful line before
    anything else. Messages are cut at MAX_MESSAGE_CHARS (some quote what the client sent).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from foveal.errors import GenerationError, IncompleteOutputError, ModelClosedError
from foveal.grammars import SchemaError
from foveal.vision import ImageError, PixelBudgetTimeout

log = logging.getLogger("foveal.server")

DEFAULT_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    422: "invalid_body",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "unavailable",
}
MAX_MESSAGE_CHARS = 2000
INTERNAL_MESSAGE = (
    "the server failed on this request (an internal error, logged on the server); retry it, and "
    "report it to the server's operator if it keeps failing"
)


def error_type(status: int) -> str:
    """OpenAI's error `type` of a status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class ApiError(Exception):
    """An error the server answers with `status`, the JSON error body and `headers`."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or DEFAULT_CODES.get(status, "error")
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return error_type(self.status)

    def body(self) -> dict[str, Any]:
        detail = {"message": http_message(self.message), "type": self.type, "param": self.param}
        return {"error": {**detail, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorBody(BaseModel):
    """The body of every error response (documented in the OpenAPI schema of every route)."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "The request was refused; `error.message` says why."},
    "5XX": {"model": ErrorBody, "description": "The server could not answer; retry later."},
}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, error.headers)


def error_event(exc: BaseException) -> dict[str, Any]:
    """The error body of an exception raised after a stream's 200 went out (sent as one event)."""
    problem = api_error(exc)
    if problem.code == "internal_error":
        log.error("unexpected error in a stream: %s", type(exc).__name__, exc_info=exc)
    return problem.body()


def api_error(exc: BaseException) -> ApiError:
    """The ApiError of an exception raised by a `Model` call (order matters: subclasses first)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SchemaError):
        return ApiError(422, str(exc), "unsupported_schema")
    if isinstance(exc, ImageError):
        return ApiError(400, str(exc), "invalid_image", "image_url")
    if isinstance(exc, PixelBudgetTimeout):  # the images are fine; the model holds its pixel budget
        return ApiError(429, str(exc), "image_budget_full", headers={"Retry-After": "1"})
    if isinstance(exc, ValueError | TypeError):
        return ApiError(400, str(exc))
    if isinstance(exc, IncompleteOutputError):
        return ApiError(422, str(exc), "incomplete_output")
    if isinstance(exc, ModelClosedError):
        return ApiError(503, str(exc), "model_closed", headers={"Retry-After": "5"})
    if isinstance(exc, GenerationError):
        return ApiError(500, str(exc), "generation_error")
    return ApiError(500, INTERNAL_MESSAGE, "internal_error")


# ---- messages in HTTP terms ----

# The SDK's Python advice and what an HTTP client does instead, applied in order; each pattern is
# one message (or clause) the SDK raises, so a message none of them matches goes out unchanged.
HTTP_TERMS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.S), replacement)
    for pattern, replacement in (
        # "query on this paligemma model needs an image; pass image=..." (and the processor's twin)
        (
            r"^.*needs an image.*pass image=\.\.\..*$",
            "this request needs an image: send one as a base64 data URL, in image_url (in chat "
            "messages, an image_url content part)",
        ),
        (r"(?:pass|call it with) image=None", "send the request without an image"),
        (r"device='([\w:]+)' was asked for", r"this server was started with --device \1"),
        (r"use device='cpu'", "restart foveal serve with --device cpu"),
        (r"; load it again with foveal\.load\(\.\.\.\) to call it", " (the server is stopping); retry later"),
        (r" or load with a larger max_model_len", ""),
        (r"settings\['(\w+)'\]", r"\1"),
        (r"; pass some text", "; send some text"),
        (r"and compile again", "and send it again"),
        # a grammar over the compile budget: the budget is the server's, set in Python
        (
            r", or raise the limit for every compile with grammars\.set_compile_budget\(.*$",
            " (this server's limit)",
        ),
    )
)

# Native text: a Rust panic (llguidance's, or the tokenizer's) with its backtrace, frames and paths.
_NATIVE = re.compile(
    r"panicked at|(?:^|\s)panic: |stack backtrace|<backtrace>|RUST_BACKTRACE|/rustc/|\.cargo/registry"
)
_NATIVE_LINE = re.compile(
    r"^\s*(?:\d+:\s|at\s|</?backtrace>|stack backtrace|note:|thread '[^']*' panicked at)"
    r"|/rustc/|\.cargo/registry"
)
_OLD_PANIC = re.compile(r"panicked at '(?P<message>.*)', \S+$")  # Rust < 1.73 put the message first
NATIVE_ADVICE = "a native library failed on this input; simplify the request and send it again"


def http_message(text: str) -> str:
    """`text` as an HTTP body may carry it: native text cut to one line, SDK advice in HTTP terms."""
    if _NATIVE.search(text):
        text = f"{_first_meaningful_line(text)}; {NATIVE_ADVICE}"
    for pattern, replacement in HTTP_TERMS:
        text = pattern.sub(replacement, text)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + f"... (cut at {MAX_MESSAGE_CHARS} characters)"
    return text


def _first_meaningful_line(text: str) -> str:
    for line in text.splitlines():
        old = _OLD_PANIC.search(line)
        if old:
            return old["message"]
        if line.strip() and not _NATIVE_LINE.search(line):
            return line.strip()
    return "an internal error in native code"


# ---- handlers ----


def install(app: FastAPI) -> None:
    """Route every error through the one body shape, and document it on every route of `app`.

    Call it before the routers are included: a route added to the app takes its router's
    `responses` then (the 4XX/5XX error bodies, which replace FastAPI's default 422 schema)."""
    app.router.responses = {**ERROR_RESPONSES, **app.router.responses}

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(api_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return error_response(_http_error(request, exc))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(_validation_error(exc))

    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    for kind in (ApiError, ValueError, TypeError, IncompleteOutputError, GenerationError):
        app.add_exception_handler(kind, on_api_error)


def _http_error(request: Request, exc: HTTPException) -> ApiError:
    """Starlette's and FastAPI's own HTTP errors (no route, wrong method, a body it cannot read)."""
    where = f"{request.method} {request.url.path}"
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        message = f"no route {where}; the routes are listed at /docs (OpenAPI schema at /openapi.json)"
    elif exc.status_code == 405:
        allowed = headers.get("Allow") or headers.get("allow") or "another method"
        message = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
    elif exc.status_code == 400:  # FastAPI's "There was an error parsing the body" (routes raise ApiError)
        return ApiError(400, NOT_JSON, "invalid_json", headers=headers)
    else:
        message = str(exc.detail)
    return ApiError(exc.status_code, message, headers=headers)


NOT_JSON = "the request body is not valid JSON; send a JSON object (Content-Type: application/json)"


def _validation_error(exc: RequestValidationError) -> ApiError:
    problems = exc.errors()
    if any(p.get("type") == "json_invalid" for p in problems):
        return ApiError(400, NOT_JSON, "invalid_json")
    first = problems[0] if problems else {}
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
    details = "; ".join(_describe(p) for p in problems)
    return ApiError(422, f"invalid request body: {details}", "invalid_body", param=where)


def _describe(problem: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in problem.get("loc", ()) if part != "body") or "body"
    message = problem.get("msg", "invalid")
    if problem.get("type") == "extra_forbidden":
        message = "unknown field; remove it"
    elif problem.get("type") == "missing":
        message = "required field is missing"
    elif where == "body" and problem.get("type") in ("model_attributes_type", "dict_type"):
        message = "must be a JSON object (Content-Type: application/json)"
    return f"{where}: {message}"
