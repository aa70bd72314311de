"""`serve()`: what `foveal serve` runs, from its socket to its exit status; `make_server()`, the uvicorn
server every foveal server runs on (BackgroundServer's too); `bind()`, its listening socket.

ORDER OF `foveal serve` (cli.py does step 1, this module the rest)
    1. The arguments are checked: --port, --max-batch-size, --device (a device torch has), --model
       (an existing folder or file, or a hub id), the server's limits. A bad one exits 2 with one
       line on stderr, before anything is bound or loaded.
    2. The listening socket is bound (`bind`): a port in use, a port this user may not bind or an
       address that is not this machine's exits 2 with one line, before the long load. uvicorn
       later serves on this same socket, so nothing can take the port between check and use.
    3. uvicorn serves on the socket and the app starts the load on a worker thread (app.py); one
       line on stdout says so, with the /health URL, which answers 503 "loading" meanwhile (a
       load can take minutes: a supervisor sees the process alive and listening).
    4. The load fails: one line on stderr (`foveal: error: the model could not be loaded: ...`),
       the server stops, exit status 1; it never serves 503 for good. The load succeeds: `foveal:
       serving on URL ...` on stdout, and the server serves until SIGINT or SIGTERM.
    5. Shutdown, below; then `foveal: stopped` on stdout and exit status 0.
    While the server runs (steps 3 to 5), transformers prints no progress bar, and with --quiet no
    warning either (`transformers_output`: its own switches, put back when serve() returns); with
    --quiet the request log is off too.

SHUTDOWN (SIGINT or SIGTERM; also BackgroundServer's exit)
    a. New model calls are refused with a JSON 503 `shutting_down`, and /health says "stopping". The
       socket stays open meanwhile, so that a client gets that answer rather than a refused
       connection, and a load balancer's health check sees the server leave.
    b. The calls in flight get `shutdown_grace_s` to finish (a second SIGINT ends the wait).
    c. Every call still in flight is cut (state.end_grace): a non-streamed one is answered 503
       `shutting_down` in errors.py's body, a stream gets an error event and `data: [DONE]`; each
       cancels its engine request. Then the engine is waited for until it is idle: every KV page
       is back in its pool.
    d. The socket is closed, and so is every connection waiting for a request or still sending
       one; the others (answering a 503, a /health) get CLOSE_S to finish, then are closed too, so
       that nothing is left for uvicorn to cancel (its cancellation answers 500 with a traceback).
    e. The app's lifespan ends: a model its loader made is closed.
    uvicorn's own handlers re-raise the signal after a graceful shutdown (so the process would die
    of it, status 130/143); `_Server` keeps the shutdown and drops the re-raise: a stop that was
    asked for and went cleanly is a success.

SLOW CLIENTS
    uvicorn closes idle keep-alive connections (`timeout_keep_alive`) and nothing else: a
    connection that never sends, or never finishes, its request head or body is held for good (h11
    buffers a head up to its size limit and waits; uvicorn has no request timeout). `_TimedH11`
    gives each request `read_timeout_s` from the moment its connection waits for it (opened, or
    its previous answer sent) until it is fully received, then closes the connection; a route
    reading the body sees the client gone. Whether a request is still being received is h11's own
    state (`their_state` IDLE or SEND_BODY).

NO DELAY
    Every accepted connection gets TCP_NODELAY. asyncio sets it only on sockets made with proto
    IPPROTO_TCP, and `socket.create_server` (bind, above; uvicorn's own binding too) makes them with
    proto 0, so Nagle's algorithm held each answer's body (uvicorn writes the head and the body
    apart) until the client acknowledged the head, which a client delays (delayed ACK): every
    /health on a kept-alive connection waited for that delay, even on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from foveal.server.app import create_app
from foveal.server.config import ServerConfig
from foveal.server.state import ServerState

log = logging.getLogger("foveal.server")
POLL_S = 0.05
CUT_S = 10.0  # step c: cut calls answer at once; this bounds a client that does not read its answer
IDLE_S = 10.0  # step c: the engine's last steps in flight
CLOSE_S = 5.0  # step d


def serve(loader: Callable[[], Any], host: str, port: int, config: ServerConfig, quiet: bool = False) -> int:
    """Steps 2 to 5 of the module docstring; returns the process exit status."""
    try:
        listener = bind(host, port)
    except OSError as error:
        print(f"foveal: error: {error}", file=sys.stderr)
        return 2

    app = create_app(loader=loader, config=config)
    server = make_server(app, host, port, config)
    with transformers_output(quiet), _request_log(logging.WARNING if quiet else logging.INFO):
        return asyncio.run(_run(server, app.state.foveal, listener, host))


def bind(host: str, port: int) -> socket.socket:
    """The listening socket of host:port, or OSError with a message that says what to do."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as error:
        raise OSError(_bind_advice(host, port, error)) from None


def _bind_advice(host: str, port: int, error: OSError) -> str:
    where = f"{host}:{port}"
    if error.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on {where}: the port is in use (another server runs there); stop it, or "
            "pass another --port (--port 0 picks a free one)"
        )
    if error.errno == errno.EACCES:
        return f"cannot listen on {where}: this user may not bind port {port}; use a port above 1023"
    if error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return (
            f"cannot listen on {where}: {host} is not an address of this machine; use 127.0.0.1 "
            "(this machine only) or 0.0.0.0 (every interface)"
        )
    return f"cannot listen on {where}: {error.strerror or error}"


@contextlib.contextmanager
def transformers_output(quiet: bool) -> Iterator[None]:
    """transformers' output while the server runs: no progress bars (a load prints them; stderr is
    for foveal's own lines), and with `quiet` no warnings either (a load prints some, and so does
    the first trace of each decode step, torch.jit.trace reading the model's properties). Both
    switches, and huggingface_hub's bars (which transformers' switch also flips), are put back as
    they were when the server stops."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hub_bars_off = hub.are_progress_bars_disabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if hub_bars_off:
            hub.disable_progress_bars()
        else:
            hub.enable_progress_bars()


def make_server(
    app: Any, host: str, port: int, config: ServerConfig, log_level: str = "warning"
) -> uvicorn.Server:
    """uvicorn over `app` with this module's shutdown and read timeout. uvicorn logs warnings and
    errors only: its startup and shutdown lines would repeat foveal's own."""
    settings = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,  # Observe logs every request with its latency
        # (uvicorn's types name a protocol class and an int; it calls any factory, and waits a float)
        http=functools.partial(_TimedH11, read_timeout_s=config.read_timeout_s),  # type: ignore[arg-type]
        ws="none",  # no websocket routes
        timeout_graceful_shutdown=CLOSE_S,  # type: ignore[arg-type]  # step d: after foveal's own drain (a to c)
        lifespan="on",
    )
    return _Server(settings, getattr(app.state, "foveal", None))


def bound_port(server: uvicorn.Server) -> int:
    """The port a started server listens on (the one the OS chose for port 0)."""
    return server.servers[0].sockets[0].getsockname()[1]


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState | None) -> None:
        super().__init__(config)
        self.state = state  # None for an app that is not create_app's: no drain then

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.state is not None:
            self.state.begin_drain()  # at once, not at uvicorn's next tick (a flag: fine in a handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.state is not None:
            await self._drain(self.state)
        await self._close_connections()
        await super().shutdown(sockets)

    async def _drain(self, state: ServerState) -> None:
        """Steps a to c."""
        state.begin_drain()
        grace = state.config.shutdown_grace_s
        if state.in_flight():
            log.info("stopping: %d calls in flight get up to %g s to finish", state.in_flight(), grace)
        await self._wait_until(lambda: not state.in_flight(), grace, forced=True)
        if state.in_flight():
            log.info("stopping: the grace is over; %d calls still in flight are cut (503)", state.in_flight())
        state.end_grace()
        await self._wait_until(lambda: not state.in_flight(), CUT_S)
        if state.model is not None:
            await asyncio.to_thread(state.model.engine.wait_idle, IDLE_S)

    async def _close_connections(self) -> None:
        """Step d: uvicorn's own shutdown then finds only connections that are closing."""
        for listener in self.servers:
            listener.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await self._wait_until(lambda: not self.server_state.connections, CLOSE_S)
        for connection in list(self.server_state.connections):  # clients that do not read their answer
            connection.transport.close()

    async def _wait_until(self, done: Callable[[], bool], seconds: float, forced: bool = False) -> None:
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline and not (forced and self.force_exit):
            await asyncio.sleep(POLL_S)


class _TimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for receiving each request (SLOW CLIENTS above)."""

    def __init__(self, *args: Any, read_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout_s = read_timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        _no_delay(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.receiving():  # a request not yet whole: the stopping server takes no new calls
            self.transport.close()
        else:
            super().shutdown()

    def receiving(self) -> bool:
        """Whether the connection waits for a request, or for the rest of one."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _watch(self) -> None:
        if not self.receiving() or self.transport.is_closing():
            self._disarm()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.receiving() and not self.transport.is_closing():
            log.info(
                "closed a connection from %s: no whole request within %g s (--read-timeout)",
                "{}:{}".format(*self.client) if self.client else "a client",
                self.read_timeout_s,
            )
            self.transport.close()


def _no_delay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on an accepted connection (NO DELAY above)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@contextlib.contextmanager
def _request_log(level: int) -> Iterator[None]:
    """The `foveal.server` log (request lines, observe.py) on stderr at `level` while serving, unless
    the logger already has a handler: uvicorn configures only its own loggers."""
    logger = logging.getLogger("foveal.server")
    handler = None
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s foveal.server %(levelname)s %(message)s"))
        logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)
        if handler is not None:
            logger.removeHandler(handler)


async def _run(server: uvicorn.Server, state: ServerState, listener: socket.socket, host: str) -> int:
    task = asyncio.create_task(server.serve(sockets=[listener]))
    while not server.started and not task.done():
        await asyncio.sleep(POLL_S)
    if not server.started:  # uvicorn logged why
        await task
        print("foveal: error: the server could not start (see the log above)", file=sys.stderr)
        return 1
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound_port(server)}"
    print(f"foveal: loading the model; {url}/health answers 503 'loading' until it is ready", flush=True)
    loaded = asyncio.ensure_future(state.loaded.wait())
    await asyncio.wait((task, loaded), return_when=asyncio.FIRST_COMPLETED)
    loaded.cancel()
    if state.load_error is not None:
        print(
            f"foveal: error: the model could not be loaded: {state.load_error}", file=sys.stderr, flush=True
        )
        server.should_exit = True
        await task
        return 1
    if state.model is not None and not server.should_exit:
        print(
            f"foveal: serving on {url} (playground {url}/, Moondream and OpenAI APIs at {url}/v1)", flush=True
        )
    await task
    print("foveal: stopped", flush=True)
    return 0
