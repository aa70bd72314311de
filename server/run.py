"""`serve()`: what `foveal serve` runs: load the model, listen, print the URL, stop cleanly on a signal.

Shutdown (SIGINT or SIGTERM): uvicorn stops accepting connections, gives requests in flight
`shutdown_grace_s` to finish, then cancels what is left (a cancelled request cancels its engine
request); the model is closed after that, and the process exits 0. A second SIGINT forces the exit.
uvicorn's own handlers re-raise the signal after a graceful shutdown (so the process would die of
it, status 130/143); `_Server` keeps the shutdown and drops the re-raise: a stop that was asked for
and went cleanly is a success.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from foveal.server.app import create_app
from foveal.server.config import ServerConfig


class _Server(uvicorn.Server):
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


def make_server(
    app: Any, host: str, port: int, config: ServerConfig, log_level: str = "info"
) -> uvicorn.Server:
    settings = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,  # Observe logs every request with its latency
        timeout_graceful_shutdown=config.shutdown_grace_s,
        lifespan="on",
    )
    return _Server(settings)


def bound_port(server: uvicorn.Server) -> int:
    """The port a started server listens on (the one the OS chose for port 0)."""
    return server.servers[0].sockets[0].getsockname()[1]


def serve(loader: Callable[[], Any], host: str, port: int, config: ServerConfig) -> int:
    """Run until SIGINT/SIGTERM; returns the process exit status (0 after a clean stop)."""
    _log_requests()
    server = make_server(create_app(loader=loader, config=config), host, port, config)
    return asyncio.run(_run(server, host))


def _log_requests() -> None:
    """Request lines (observe.py) on stderr: uvicorn configures only its own loggers."""
    logger = logging.getLogger("foveal.server")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s foveal.server %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


async def _run(server: uvicorn.Server, host: str) -> int:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{bound_port(server)}"
        print(
            f"foveal: serving on {url} (playground {url}/, Moondream and OpenAI APIs at {url}/v1)", flush=True
        )
    await task
    if not server.started:  # e.g. the port is taken: uvicorn logged why
        print("foveal: error: the server could not start (see the log above)", file=sys.stderr)
        return 1
    print("foveal: stopped", flush=True)
    return 0
