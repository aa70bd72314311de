"""Operations routes: `/health`, `/metrics` (Prometheus text, metrics.py) and the playground page at
`/` (static/playground.html, shipped in the package).

`/health` answers 200 `{"status": "ok"}` once the model is loaded and 503 otherwise, with the
status "loading", "failed" (and the error) or "stopping" (the server is shutting down: a load
balancer takes it out of rotation while the calls in flight finish).
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from foveal.server.state import state_of

router = APIRouter(tags=["operations"])
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = state_of(request)
    if state.draining:
        return JSONResponse({"status": "stopping", "error": None}, 503, {"Retry-After": "5"})
    if state.model is None:
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, 503, {"Retry-After": "5"})
    return JSONResponse({"status": "ok", "model": state.config.model_name})


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


@router.get("/", include_in_schema=False)
async def playground() -> HTMLResponse:
    page = resources.files("foveal.server").joinpath("static/playground.html").read_text("utf-8")
    return HTMLResponse(page)
