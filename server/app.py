"""`create_app`: the FastAPI application over one `Model` (or over a loader that makes it).

    app = create_app(model)                      # a model loaded by the caller, e.g. in tests
    app = create_app(loader=lambda: foveal.load(path), config=ServerConfig(api_key="..."))

With a loader, the model loads in a worker thread when the app starts (uvicorn is already
listening: /health says 503 "loading" until it is ready, and model routes answer 503). When the
load ends, either way, `state.loaded` is set; a failure is kept in `state.load_error` (reported by
/health and every model route, and by `foveal serve` as its one line before it exits, run.py), not
logged here. The app never closes a model it was given; it closes one its loader made, when it
stops. An app stopped during its load waits for the load to end (a load is not interruptible
midway) and closes the model it made. A model its loader made is settled (heap.py: the load's
objects frozen out of the collector's full collections) before the first request sees it.

Middleware order (outermost first): Observe (metrics and logs of every request, refused ones
included), Gate (API key, body limit), then FastAPI's routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

import foveal
from foveal.server import errors, generate_api, heap, moondream_api, openai_api, ops
from foveal.server.admission import ClientGone
from foveal.server.config import ServerConfig
from foveal.server.gate import Gate
from foveal.server.observe import CLIENT_CLOSED, Observe
from foveal.server.state import ServerState

log = logging.getLogger("foveal.server")


def create_app(
    model: Any = None, *, loader: Callable[[], Any] | None = None, config: ServerConfig | None = None
) -> FastAPI:
    if (model is None) == (loader is None):
        raise ValueError(
            "create_app takes a model or a loader (a function returning a model), not both or neither"
        )
    state = ServerState(config or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = None
        if model is not None:
            state.set_model(model)
            state.loaded.set()
        else:
            loading = asyncio.create_task(_load(state, loader))
        try:
            yield
        finally:
            if loading is not None:
                await loading
                if state.model is not None:
                    await asyncio.to_thread(state.model.close)
                    heap.thaw()

    app = FastAPI(
        title="foveal", version=foveal.__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None
    )
    app.state.foveal = state
    errors.install(app)

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; Observe counts it

    app.add_exception_handler(ClientGone, on_client_gone)
    for module in (moondream_api, openai_api, generate_api, ops):
        app.include_router(module.router)
    app.add_middleware(Gate, api_key=state.config.api_key, max_body_bytes=state.config.max_body_bytes)
    app.add_middleware(Observe, metrics=state.metrics)
    return app


async def _load(state: ServerState, loader: Callable[[], Any]) -> None:
    try:
        loaded = await asyncio.to_thread(loader)
        await asyncio.to_thread(heap.settle)  # before the first request: heap.py
        state.set_model(loaded)
    except Exception as error:  # reported by /health, every model route and `foveal serve`
        state.load_error = " ".join(f"{type(error).__name__}: {error}".split())  # one line
    else:
        log.info("model loaded: %r", loaded)
    finally:
        state.loaded.set()
