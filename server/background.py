"""`BackgroundServer`: the real server (uvicorn, loopback, a free port) in a thread of this process,
for tests, benchmarks and notebooks.

    with BackgroundServer(create_app(model)) as url:      # "http://127.0.0.1:PORT"
        moondream.vl(endpoint=f"{url}/v1").detect(image, "circle")

The socket is bound before the thread starts (run.bind: a port in use raises OSError here, saying
what to do). Leaving the block stops the server as SIGTERM stops `foveal serve` (run.py's shutdown:
calls in flight get the config's grace, then are answered 503); `stop()` does the same earlier.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from foveal.server.config import ServerConfig
from foveal.server.run import bind, make_server


class BackgroundServer:
    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 60.0
    ) -> None:
        state = getattr(app.state, "foveal", None)  # an app of create_app's has its config there
        config = state.config if state is not None else ServerConfig()
        self.server = make_server(app, host, port, config, log_level="warning")
        self.host = host
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> str:
        listener = bind(self.host, self.port)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [listener]}, name="foveal-server", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host} within {self.start_timeout_s} s")
            time.sleep(0.02)
        self.url = f"http://{self.host}:{listener.getsockname()[1]}"
        return self.url

    def stop(self, timeout: float = 60.0) -> None:
        """Shut down (run.py's SHUTDOWN) and wait until the server thread ended."""
        self.server.handle_exit(signal.SIGTERM, None)
        if self.thread is not None:
            self.thread.join(timeout=timeout)

    def __exit__(self, *exc: object) -> None:
        self.stop()
