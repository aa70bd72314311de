"""Operations routes: `/health`, `/metrics` (Prometheus text, metrics.py) and the playground page at
`/` (static/playground.html, shipped in the package) with its icon at `/favicon.ico`.

`/health` (GET or HEAD) answers 200 `{"status": "ok"}` once the model is loaded and 503 otherwise, with the
status "loading", "failed" or "stopping" (the server is shutting down: a load balancer takes it out
of rotation while the calls in flight finish) beside the error body every route answers
(`{"error": {"message", "type", "param", "code"}}`, in HTTP terms: errors.py).
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from foveal.server.errors import ApiError
from foveal.server.state import state_of

router = APIRouter(tags=["operations"])
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.head("/health", include_in_schema=False)  # load balancers' and curl -I's probe (GET's answer, no body)
@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = state_of(request)
    if state.draining:
        return _unavailable(
            "stopping", "the server is shutting down; send calls to another replica", "shutting_down"
        )
    if state.model is None and state.load_error:
        return _unavailable(
            "failed", f"the model could not be loaded: {state.load_error}", "model_load_failed"
        )
    if state.model is None:
        return _unavailable("loading", "the model is still loading; retry shortly", "model_not_ready")
    return JSONResponse({"status": "ok", "model": state.config.model_name})


def _unavailable(status: str, message: str, code: str) -> JSONResponse:
    body = {"status": status, **ApiError(503, message, code).body()}
    return JSONResponse(body, 503, {"Retry-After": "5"})


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    state = state_of(request)
    stats = None
    if state.model is not None:
        engine = state.model.engine
        stats = {
            **engine.stats(),
            "foveal_engine_kv_pages_free": engine.free_pages(),
            "foveal_engine_kv_pages_total": engine.config.num_pages,
        }
    return PlainTextResponse(state.metrics.render(stats), media_type=PROMETHEUS_TEXT)


# The playground's icon (its page links it; a browser asks for /favicon.ico anyway): a dot in an
# SVG, so that a page load logs no 404.
FAVICON_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    '<circle cx="8" cy="8" r="6" fill="#2a6fdb"/><circle cx="8" cy="8" r="2.5" fill="#fff"/></svg>'
)


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    return Response(FAVICON_SVG, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})


@router.get("/", include_in_schema=False)
async def playground() -> HTMLResponse:
    page = resources.files("foveal.server").joinpath("static/playground.html").read_text("utf-8")
    return HTMLResponse(page)
