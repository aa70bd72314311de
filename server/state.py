"""`ServerState`: what every route shares (config, metrics, admission, the model once loaded, the
shutdown's progress), kept on `app.state.foveal`; `call()`, the one path of a non-streamed model
call, and `stream_call()`, of a streamed one.

Shutdown (run.py drives it): `begin_drain()` makes every new model call a 503 `shutting_down`
(and /health say "stopping"); calls admitted before finish as usual until `end_grace()`, which cuts
every call still running: a non-streamed one is answered 503, a stream gets an error event and
`data: [DONE]` (the events of `SHUTDOWN_FINAL`), and each cancels its engine request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from foveal.server.admission import Admission, cancel_on_disconnect, shutting_down
from foveal.server.config import ServerConfig
from foveal.server.errors import ApiError, error_event
from foveal.server.metrics import Metrics
from foveal.server.streaming import EventStream, sse

T = TypeVar("T")
NOT_ADMITTED = "it takes no new calls"
CUT = "this stream was still running when its shutdown grace ended, and was cancelled"
# A stream the shutdown cuts ends with these events: the error (the error body of every route), then
# OpenAI's end of stream, which the openai client and Moondream's chat client stop at.
SHUTDOWN_FINAL = (sse(error_event(shutting_down(CUT))), sse("[DONE]"))


@dataclass
class ServerState:
    config: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    model: Any = None  # a foveal.Model once loaded
    load_error: str | None = None
    admission: Admission = field(init=False)
    loaded: asyncio.Event = field(default_factory=asyncio.Event)  # the load ended, either way
    draining: bool = False  # shutdown began: new model calls are refused
    grace_over: asyncio.Event = field(default_factory=asyncio.Event)  # calls in flight are cut

    def __post_init__(self) -> None:
        self.admission = Admission(self.config.max_queue, self.metrics)

    def set_model(self, model: Any) -> None:
        self.model = model

    def ready_model(self) -> Any:
        if self.draining:
            raise shutting_down(NOT_ADMITTED)
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

    def in_flight(self) -> int:
        return self.metrics.in_flight

    def begin_drain(self) -> None:
        """New model calls get 503 from now on; those in flight go on."""
        self.draining = True

    def end_grace(self) -> None:
        """Cut every model call still in flight (each answers 503 and cancels its engine request)."""
        self.draining = True
        self.grace_over.set()


def state_of(request: Request) -> ServerState:
    return request.app.state.foveal


async def call(request: Request, make: Callable[[Any], Awaitable[T]]) -> T:
    """Admit a call, run `make(model)` until done, until the client disconnects (which cancels it) or
    until the shutdown grace is over (which cancels it and answers 503)."""
    state = state_of(request)
    model = state.ready_model()
    async with state.admission.slot():
        return await cancel_on_disconnect(request, make(model), state.metrics, state.grace_over)


async def stream_call(
    request: Request, start: Callable[[Any], Awaitable[T]], lines: Callable[[T], AsyncIterator[str]]
) -> EventStream:
    """Admit a streamed call and start it (`start(model)`: its input is checked before the 200 goes
    out), then answer `lines(result)` as Server-Sent Events; the slot is held until the stream ends."""
    state = state_of(request)
    model = state.ready_model()
    state.admission.admit()
    try:
        result = await cancel_on_disconnect(request, start(model), state.metrics, state.grace_over)
        return EventStream(
            lines(result), on_close=state.admission.release, stop=state.grace_over, final=SHUTDOWN_FINAL
        )
    except BaseException:
        state.admission.release()
        raise
