"""An optional timeline of the engine in Chrome trace format (open it in chrome://tracing or Perfetto).

Spans are (name, lane, start, end) in perf_counter seconds; lanes are "scheduler" (launch, commit,
finalize, text, wait) and "device" (forward, sample, copy). Disabled traces record nothing; an enabled
trace keeps at most `limit` spans so a long run cannot grow memory without bound.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

LANES = {"scheduler": 1, "device": 2}


class Trace:
    def __init__(self, enabled: bool = False, limit: int = 200_000) -> None:
        self.enabled = enabled
        self._limit = limit
        self._spans: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()

    def span(self, name: str, lane: str, start: float, end: float) -> None:
        if self.enabled and len(self._spans) < self._limit:
            with self._lock:
                self._spans.append((name, lane, start, end))

    def to_chrome(self) -> dict:
        with self._lock:
            spans = list(self._spans)
        t0 = min((s[2] for s in spans), default=0.0)
        events = [
            {
                "name": name,
                "ph": "X",
                "pid": 1,
                "tid": LANES[lane],
                "ts": (a - t0) * 1e6,
                "dur": (b - a) * 1e6,
            }
            for name, lane, a, b in spans
        ]
        meta = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
            for lane, tid in LANES.items()
        ]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome()))
