"""`Metrics`: the server's counters, rendered in Prometheus' text exposition format (version 0.0.4).

Counted here (on the event loop thread only, so no locks): requests by route and status, request
latency as a histogram by route, admitted model calls in flight (the queue depth that --max-queue
bounds), client disconnects (observe.py counts a response its client left, dropped streams
included; admission.py a model call its client left before the answer started), completion
tokens answered. Read from the engine at scrape time (`engine.stats()`, since the engine started
or its stats were last reset): decode steps, tokens, mean forward and host time per step, the
device's idle fraction while the engine had work, and the KV pages free.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency_buckets: dict[str, list[int]] = defaultdict(lambda: [0] * len(LATENCY_BUCKETS_S))
        self.latency_sum: dict[str, float] = defaultdict(float)
        self.latency_count: dict[str, int] = defaultdict(int)
        self.in_flight = 0  # admitted model calls (admission.py)
        self.rejected_queue_full = 0
        self.disconnects = 0  # requests whose client left before the answer ended (streams too)
        self.completion_tokens = 0

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests[(route, status)] += 1
        self.latency_sum[route] += seconds
        self.latency_count[route] += 1
        buckets = self.latency_buckets[route]
        for i, bound in enumerate(LATENCY_BUCKETS_S):
            if seconds <= bound:
                buckets[i] += 1

    def render(self, engine_stats: dict[str, Any] | None) -> str:
        lines: list[str] = []
        _family(lines, "foveal_http_requests_total", "counter", "HTTP requests by route and status")
        for (route, status), n in sorted(self.requests.items()):
            lines.append(f'foveal_http_requests_total{{route="{route}",status="{status}"}} {n}')
        _family(lines, "foveal_http_request_duration_seconds", "histogram", "HTTP request latency by route")
        for route in sorted(self.latency_count):
            for bound, n in zip(LATENCY_BUCKETS_S, self.latency_buckets[route], strict=True):
                lines.append(
                    f'foveal_http_request_duration_seconds_bucket{{route="{route}",le="{bound}"}} {n}'
                )
            count = self.latency_count[route]
            lines.append(f'foveal_http_request_duration_seconds_bucket{{route="{route}",le="+Inf"}} {count}')
            lines.append(
                f'foveal_http_request_duration_seconds_sum{{route="{route}"}} {self.latency_sum[route]}'
            )
            lines.append(f'foveal_http_request_duration_seconds_count{{route="{route}"}} {count}')
        for name, kind, help_text, value in (
            ("foveal_queue_depth", "gauge", "model calls admitted and not finished", self.in_flight),
            (
                "foveal_rejected_queue_full_total",
                "counter",
                "requests refused with 429",
                self.rejected_queue_full,
            ),
            (
                "foveal_client_disconnects_total",
                "counter",
                "requests whose client left before the answer ended, dropped streams included",
                self.disconnects,
            ),
            (
                "foveal_completion_tokens_total",
                "counter",
                "tokens answered over HTTP",
                self.completion_tokens,
            ),
        ):
            _family(lines, name, kind, help_text)
            lines.append(f"{name} {value}")
        if engine_stats is not None:
            _engine(lines, engine_stats)
            for name, help_text in (
                ("foveal_engine_kv_pages_free", "KV cache pages free"),
                ("foveal_engine_kv_pages_total", "KV cache pages in the pool"),
            ):
                if name in engine_stats:
                    _family(lines, name, "gauge", help_text)
                    lines.append(f"{name} {engine_stats[name]}")
        return "\n".join(lines) + "\n"


def _engine(lines: list[str], stats: dict[str, Any]) -> None:
    busy = stats.get("device_busy_fraction", 0.0)
    active = stats.get("active_s", 0.0)
    for name, kind, help_text, value in (
        ("foveal_engine_steps_total", "counter", "engine steps (prefill and decode)", stats.get("steps", 0)),
        ("foveal_engine_tokens_total", "counter", "tokens the engine generated", stats.get("tokens", 0)),
        ("foveal_engine_active_seconds_total", "counter", "seconds the engine had work", active),
        (
            "foveal_engine_step_forward_ms",
            "gauge",
            "mean forward time per step",
            stats.get("forward_ms", 0.0),
        ),
        (
            "foveal_engine_step_host_ms",
            "gauge",
            "mean host bookkeeping per step",
            stats.get("host_ms_per_step", 0.0),
        ),
        (
            "foveal_engine_device_idle_fraction",
            "gauge",
            "fraction of the engine's active time the device was idle",
            (1.0 - busy) if active > 0 else 0.0,
        ),
    ):
        _family(lines, name, kind, help_text)
        lines.append(f"{name} {_number(value)}")


def _family(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")


def _number(value: float) -> str:
    return "NaN" if isinstance(value, float) and math.isnan(value) else str(value)
