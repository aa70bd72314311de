"""`ManualDevice`: a synchronous stand-in for the engine's device, for stepping the pipeline by hand.

PROBLEM
    The pipeline's invariants (a slot reused only after commit read it, zombies' refs, oldest-first
    commit, no forward past max_tokens, pages freed) are about the order of host and device work.
    Tested through threads they need sleeps and luck; a test must be able to stop between any two
    phases and look.
SOLUTION
    The `Device` protocol of engine/device.py with no thread: `run` and `copy_to_host` queue jobs,
    and queued jobs run, in order, on the caller's thread only when something needs them: `wait`
    on a copy's event runs the queue up to that copy, `synchronize` runs all of it. A test builds a
    `Pipeline` over it and calls `tick()` (or the phases) itself; `pending()` names the jobs not
    run yet, and `log` every job run, in order.
INVARIANTS
    - Jobs run in the order they were queued, each exactly once, and only inside `wait`/`synchronize`.
    - A job's exception is re-raised by the `wait` that ran it (and by every later wait).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class CopyEvent:
    done: bool = False


@dataclass
class ManualDevice:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    log: list[str] = field(default_factory=list)  # names of the jobs run, in order
    busy_s: float = 0.0
    job_s: dict[str, float] = field(default_factory=dict)
    job_n: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._queue: deque[tuple[str, Callable[[], None], CopyEvent | None]] = deque()
        self._error: BaseException | None = None

    def run(self, name: str, fn: Callable[[], None]) -> None:
        self._queue.append((name, fn, None))

    def threads_for(self, tokens: int, forwards: int = 1) -> None:
        return None  # tests drive the queue by hand: torch's thread count is left alone

    def copy_to_host(self, name: str, fn: Callable[[], None]) -> CopyEvent:
        event = CopyEvent()
        self._queue.append((name, fn, event))
        return event

    def pending(self) -> list[str]:
        return [name for name, _, _ in self._queue]

    def wait(self, event: CopyEvent) -> None:
        while not event.done and self._queue:
            self._run_next()
        self._raise()

    def synchronize(self) -> None:
        while self._queue:
            self._run_next()
        self._raise()

    def _run_next(self) -> None:
        name, fn, event = self._queue.popleft()
        if self._error is None:
            try:
                fn()
            except BaseException as error:  # re-raised by wait(), as the real devices do
                self._error = error
        self.log.append(name)
        self.job_n[name] = self.job_n.get(name, 0) + 1
        if event is not None:
            event.done = True

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"device work failed: {self._error!r}") from self._error

    def close(self) -> None:
        self.synchronize()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor
