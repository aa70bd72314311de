"""Where launched work runs: the `Device` protocol, an in-order device queue with host-copy events.

PROBLEM
    The scheduler must queue step t+1's forward and keep doing Python bookkeeping for step t while
    the accelerator computes; it waits only when it needs a step's sampled ids on the host.
SOLUTION
    `Device` declares what the pipeline, its slots and the Engine call on a device; `Pipeline`
    checks it once, when it is built (matcher.require). Two implementations (and the tests'
    synchronous `foveal.testing.ManualDevice`):
    `CudaDevice`: work is issued at once under a compute stream; device-to-host copies go on a copy
    stream that waits for the compute stream and records an event.
    `CpuDevice`: a worker thread executes launched closures in order (forward and sampler are native
    torch calls or sleeps that release the GIL), and a copy's event is a lock, taken when the copy is
    queued and released by the worker after it ran (a lock is the cheapest such event in Python, on
    both threads; a `threading.Event` costs several times more per step). `run(name, fn)` queues
    compute work; `copy_to_host(name, fn)` queues a copy and returns the event that `wait` blocks on.
    On CPU the worker also picks each forward's intra-op thread count (`threads_for`, called by the
    forward job as it starts): launches of `SMALL_LAUNCH_TOKENS` query tokens or more run on the
    count torch had when the device was made; smaller ones (decode, a verify step, a forced run)
    on the count a `ThreadChooser` (engine/threads.py) finds fastest by timing them, or on
    `small_launch_threads` where a caller fixes it (benchmarks compare counts) or the environment
    variable FOVEAL_DECODE_THREADS does. A fixed count also makes a process's answers independent
    of the counts the chooser tries: torch's CPU attention and float32 GEMM round some shapes
    differently on 1 and 2 threads, in the last bits (the test suite runs on 1). A small launch has
    little work per op: on a quiet machine it still gains from every core, but where other
    processes hold the cores one OpenMP thread is preempted and every parallel op waits for it, so
    one thread wins; large launches gain from all of them either way (benchmarks/llamacpp.py's
    free-text and 32-request JSON workloads show both). torch's thread count is process-wide, so a forward that changes it puts it back
    when it ends (device_jobs.forward).
INVARIANTS
    - Work runs in the order it was queued (one compute stream / one worker).
    - A worker error is re-raised by the next `wait`; events are still released, so nothing hangs.
    - `busy_s` is the device's busy time: CPU, summed job time; CUDA, compute-stream time from
      timing events, counted once their step has been waited for.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Protocol, runtime_checkable

import torch

from .threads import ThreadChooser
from .trace import Trace

Job = Callable[[], None]
SMALL_LAUNCH_TOKENS = 8  # CPU forwards of fewer query tokens than this get their thread count by timing
DECODE_THREADS_ENV = "FOVEAL_DECODE_THREADS"  # a count fixes `small_launch_threads`; unset or "auto": timed


def decode_threads_from_env() -> int | None:
    """`CpuDevice.small_launch_threads` as FOVEAL_DECODE_THREADS sets it (None: timed)."""
    value = os.environ.get(DECODE_THREADS_ENV, "").strip()
    if value in ("", "auto"):
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DECODE_THREADS_ENV} must be a thread count >= 1 or 'auto', got {value!r}")
    return int(value)


@runtime_checkable
class Device(Protocol):
    """What the engine calls on the device its launched work runs on (the module docstring).

    Only the scheduler thread calls these (but `threads_for`); an event is opaque, good for one
    `wait` or several."""

    device: torch.device  # where the runner's tensors live
    busy_s: float  # device busy time so far (the Engine's stats read and reset it)
    job_s: dict[str, float]  # busy time per job name
    job_n: dict[str, int]  # jobs run per job name

    def run(self, name: str, fn: Job) -> None:
        """Queue compute work `fn`; it runs after everything queued before it."""
        ...

    def copy_to_host(self, name: str, fn: Job) -> Any:
        """Queue a device-to-host copy `fn` after the compute queued so far; returns its event."""
        ...

    def wait(self, event: Any) -> None:
        """Block until the copy of `event` has run; raise RuntimeError if any queued work failed."""
        ...

    def synchronize(self) -> None:
        """Block until everything queued has run; raise RuntimeError if any of it failed."""
        ...

    def threads_for(self, tokens: int, forwards: int = 1) -> int | None:
        """Intra-op threads for a job of `forwards` forwards of `tokens` query tokens each (a decode
        burst runs several: bursts.py); None: leave torch's count alone.

        The forward job calls it where it runs (on CPU, the device's worker), as it starts."""
        ...

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, or a page-locked copy of it where host-to-device copies need one (CUDA)."""
        ...

    def close(self) -> None:
        """Run what is queued and stop; the device takes no more work."""
        ...


class CpuDevice:
    def __init__(self, trace: Trace) -> None:
        self.device = torch.device("cpu")
        self._trace = trace
        self._queue: queue.SimpleQueue[tuple[str, Job, threading.Lock | None] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.busy_s = 0.0
        self.job_s: dict[str, float] = {}
        self.job_n: dict[str, int] = {}
        self.threads = torch.get_num_threads()  # what the process asked for when the engine started
        # fixes the count under SMALL_LAUNCH_TOKENS (None: timed); FOVEAL_DECODE_THREADS sets it
        self.small_launch_threads: int | None = decode_threads_from_env()
        self.chooser = ThreadChooser(self.threads)
        # (shape, threads) of the job running, when timed: its query tokens, or (tokens, forwards) of a burst
        self._chosen: tuple[Hashable, int] | None = None
        self._thread = threading.Thread(target=self._work, name="foveal-device", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            name, fn, event = item
            t0 = time.perf_counter()
            if self._error is None:
                try:
                    fn()
                except BaseException as e:  # re-raised on the scheduler thread by wait()
                    self._error = e
            t1 = time.perf_counter()
            if self._chosen is not None:  # a small forward on the chooser's count: time it
                if self._error is None:
                    self.chooser.observe(*self._chosen, t1 - t0)
                self._chosen = None
            self.busy_s += t1 - t0
            self.job_s[name] = self.job_s.get(name, 0.0) + (t1 - t0)
            self.job_n[name] = self.job_n.get(name, 0) + 1
            self._trace.span(name, "device", t0, t1)
            if event is not None:
                event.release()

    def run(self, name: str, fn: Job) -> None:
        self._queue.put((name, fn, None))

    def threads_for(self, tokens: int, forwards: int = 1) -> int:
        """Intra-op threads for a job of `forwards` forwards of `tokens` query tokens each (the module
        docstring): chosen by the size of one forward, timed apart from jobs of another shape.

        Called on the worker by the forward job as it starts, so the worker times that job."""
        if tokens >= SMALL_LAUNCH_TOKENS:
            return self.threads
        if self.small_launch_threads is not None:
            return self.small_launch_threads
        threads = self.chooser.pick()
        if threading.current_thread() is self._thread:  # a forward job: the worker times it
            self._chosen = (tokens if forwards == 1 else (tokens, forwards), threads)
        return threads

    def copy_to_host(self, name: str, fn: Job) -> threading.Lock:
        event = threading.Lock()
        event.acquire()  # released by the worker once `fn` ran
        self._queue.put((name, fn, event))
        return event

    def wait(self, event: Any) -> None:
        with event:  # blocks until the worker released it; released again, so waiting twice is fine
            pass
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"device work failed: {self._error!r}") from self._error

    def synchronize(self) -> None:
        self.wait(self.copy_to_host("sync", lambda: None))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t


class CudaDevice:
    def __init__(self, device: torch.device, trace: Trace) -> None:
        self.device = device
        self._trace = trace
        self.compute = torch.cuda.Stream(device)
        self.copy = torch.cuda.Stream(device)
        self.busy_s = 0.0
        self.job_s: dict[str, float] = {}
        self.job_n: dict[str, int] = {}
        self._timed: deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = deque()

    def run(self, name: str, fn: Job) -> None:
        with torch.cuda.stream(self.compute):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.compute)
            fn()
            end.record(self.compute)
        self._timed.append((name, start, end))

    def threads_for(self, tokens: int, forwards: int = 1) -> None:
        return None  # CPU threads do not drive CUDA kernels: leave torch's count alone

    def copy_to_host(self, name: str, fn: Job) -> torch.cuda.Event:
        self.copy.wait_stream(self.compute)
        with torch.cuda.stream(self.copy):
            fn()
            event = torch.cuda.Event()
            event.record(self.copy)
        # No compute-side wait on this copy: the buffers it reads are rewritten only by a later
        # step of the same slot, which the scheduler issues after waiting for this event.
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()
        self._account()

    def _account(self) -> None:
        """Add the GPU time of finished compute jobs (compute-stream jobs never overlap each other)."""
        while self._timed and self._timed[0][2].query():
            name, start, end = self._timed.popleft()
            seconds = start.elapsed_time(end) / 1e3
            self.busy_s += seconds
            self.job_s[name] = self.job_s.get(name, 0.0) + seconds
            self.job_n[name] = self.job_n.get(name, 0) + 1

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        self._account()

    def close(self) -> None:
        self.synchronize()

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()


def make_device(device: torch.device, trace: Trace) -> Device:
    if device.type == "cuda":
        return CudaDevice(device, trace)
    if device.type == "cpu":
        return CpuDevice(trace)
    raise ValueError(f"unsupported runner device {device}; use a 'cpu' or 'cuda' runner")
