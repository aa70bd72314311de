"""`BackgroundServer`: the real server (uvicorn, loopback, a free port) in a thread of this process,
for tests, benchmarks and notebooks.

    with BackgroundServer(create_app(model)) as url:      # "http://127.0.0.1:PORT"
        moondream.vl(endpoint=f"{url}/v1").detect(image, "circle")
"""

from __future__ import annotations

import threading
import time
from typing import Any

from foveal.server.config import ServerConfig
from foveal.server.run import bound_port, make_server


class BackgroundServer:
    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 60.0
    ) -> None:
        state = getattr(app.state, "foveal", None)  # an app of create_app's has its config there
        config = state.config if state is not None else ServerConfig()
        self.server = make_server(app, host, port, config, log_level="warning")
        self.host = host
        self.start_timeout_s = start_timeout_s
        self.thread = threading.Thread(target=self.server.run, name="foveal-server", daemon=True)
        self.url = ""

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host} within {self.start_timeout_s} s")
            time.sleep(0.02)
        self.url = f"http://{self.host}:{bound_port(self.server)}"
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
