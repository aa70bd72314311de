"""HTTP errors: one JSON body shape for every failure, and the SDK's exceptions mapped to statuses.

Every error answers `{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`, the shape
OpenAI's clients parse (so `openai.BadRequestError.message` shows our message), used on every route.

The SDK refuses bad input before any work with exceptions whose messages already say what to fix;
the server keeps those messages and picks the status:

    ValueError, TypeError (bad settings, empty phrase, ...)  400 invalid_request_error
    foveal.vision.ImageError                                 400 invalid_image
    foveal.grammars.SchemaError                              422 unsupported_schema
    IncompleteOutputError (answer cut by max_tokens)         422 incomplete_output
    ModelClosedError (model closed, server stopping)         503 model_closed
    GenerationError (engine failure)                         500 generation_error
    request body fails its model (missing / wrong field)     422 invalid_request_error
    malformed JSON                                           400 invalid_json
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from foveal.errors import GenerationError, IncompleteOutputError, ModelClosedError
from foveal.grammars import SchemaError
from foveal.vision import ImageError


class ApiError(Exception):
    """An error the server answers with `status` and the JSON error body (plus `headers`)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers or {}


def error_body(message: str, type: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": type}}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.type, error.param), error.status, error.headers)


def error_event(exc: BaseException) -> dict[str, Any]:
    """The error body of an exception raised after a stream's 200 went out (sent as one event)."""
    problem = api_error(exc)
    return error_body(problem.message, problem.type)


def api_error(exc: BaseException) -> ApiError:
    """The ApiError of an exception raised by a `Model` call (order matters: subclasses first)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SchemaError):
        return ApiError(422, str(exc), "unsupported_schema")
    if isinstance(exc, ImageError):
        return ApiError(400, str(exc), "invalid_image", "image_url")
    if isinstance(exc, ValueError | TypeError):
        return ApiError(400, str(exc))
    if isinstance(exc, IncompleteOutputError):
        return ApiError(422, str(exc), "incomplete_output")
    if isinstance(exc, ModelClosedError):
        return ApiError(503, str(exc), "model_closed", headers={"Retry-After": "5"})
    if isinstance(exc, GenerationError):
        return ApiError(500, str(exc), "generation_error")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


def install(app: FastAPI) -> None:
    """Route every error through the one body shape."""

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(api_error(exc))

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return error_response(
                ApiError(400, "the request body is not valid JSON; send a JSON object", "invalid_json")
            )
        first = problems[0] if problems else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        details = "; ".join(_describe(p) for p in problems)
        return error_response(ApiError(422, f"invalid request body: {details}", param=where))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    for kind in (ValueError, TypeError, IncompleteOutputError, GenerationError):
        app.add_exception_handler(kind, on_api_error)


def _describe(problem: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in problem.get("loc", ()) if part != "body") or "body"
    message = problem.get("msg", "invalid")
    if problem.get("type") == "extra_forbidden":
        message = "unknown field; remove it"
    elif problem.get("type") == "missing":
        message = "required field is missing"
    return f"{where}: {message}"
