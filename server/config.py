"""`ServerConfig`: the server's own knobs (the model's are `foveal.load`'s), checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 16 * 2**20  # a 16 MB JSON body holds a ~12 MB image as a base64 data URL


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """api_key: required on /v1 routes when set (X-Moondream-Auth or Authorization: Bearer).
    max_queue: model calls admitted at once (running or waiting in the engine); more get 429.
    max_body_bytes: larger request bodies get 413.
    model_name: the id /v1/models lists and responses echo.
    shutdown_grace_s: on SIGINT/SIGTERM, calls in flight get this long to finish; those still
        running then are cancelled and answered 503 (run.py).
    read_timeout_s: a client has this long to send a whole request (head and body) from the moment
        the connection waits for it (opened, or its previous answer sent); then it is closed. The
        default lets a 16 MB body arrive at 0.6 MB/s.
    """

    api_key: str | None = None
    max_queue: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    model_name: str = "foveal"
    shutdown_grace_s: float = 10.0
    read_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be a non-empty string, or None for no authentication")
        for name in ("max_queue", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0 seconds, got {self.shutdown_grace_s!r}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0 seconds, got {self.read_timeout_s!r}")
