"""`ServerState`: what every route shares (config, metrics, admission, the model once loaded), kept on
`app.state.foveal`; `call()`, the one path of a non-streamed model call, and `stream_call()`, of a streamed one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from foveal.server.admission import Admission, cancel_on_disconnect
from foveal.server.config import ServerConfig
from foveal.server.errors import ApiError
from foveal.server.metrics import Metrics
from foveal.server.streaming import EventStream

T = TypeVar("T")


@dataclass
class ServerState:
    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    model: Any = None  # a foveal.Model once loaded
    load_error: str | None = None
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.config.max_queue, self.metrics)

    def set_model(self, model: Any) -> None:
        self.model = model

    def ready_model(self) -> Any:
        if self.model is None:
            why = (
                f"the model failed to load: {self.load_error}"
                if self.load_error
                else "the model is still loading"
            )
            raise ApiError(
                503,
                f"{why}; GET /health says when it is ready",
                "model_not_ready",
                headers={"Retry-After": "5"},
            )
        return self.model


def state_of(request: Request) -> ServerState:
    return request.app.state.foveal


async def call(request: Request, make: Callable[[Any], Awaitable[T]]) -> T:
    """Admit a call, run `make(model)` until done or until the client disconnects (which cancels it)."""
    state = state_of(request)
    model = state.ready_model()
    async with state.admission.slot():
        return await cancel_on_disconnect(request, make(model), state.metrics)


async def stream_call(
    request: Request, start: Callable[[Any], Awaitable[T]], lines: Callable[[T], AsyncIterator[str]]
) -> EventStream:
    """Admit a streamed call and start it (`start(model)`: its input is checked before the 200 goes
    out), then answer `lines(result)` as Server-Sent Events; the slot is held until the stream ends."""
    state = state_of(request)
    model = state.ready_model()
    state.admission.admit()
    try:
        result = await cancel_on_disconnect(request, start(model), state.metrics)
        return EventStream(lines(result), on_close=state.admission.release)
    except BaseException:
        state.admission.release()
        raise
