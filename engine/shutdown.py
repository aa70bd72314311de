"""Engines still open when the interpreter exits are closed before Python stops their threads.

PROBLEM
    An engine's threads (`foveal-engine`, and on CPU `foveal-device`) are daemon threads, so that a
    forgotten engine never keeps a process alive. But at exit Python finalizes with daemon threads
    still running, and one that comes back from native code and asks for the GIL is ended with
    `pthread_exit`. Its forced unwind runs through C++ frames that may not unwind (TorchScript's
    replay of a traced decode step restoring the GIL through pybind11), so the C++ runtime calls
    std::terminate: "terminate called without an active exception", SIGABRT, exit status 134.
    Any script that ends without `close()` while a step is still on the device hits it: a call in
    flight on another thread, or the zombie step that rides one step past a finished request
    (gdb shows the device thread in `torch::jit::runAndInsertCall` -> `take_gil` ->
    `pthread_exit` -> `std::terminate`).
SOLUTION
    Each engine registers here when it starts; an `atexit` handler closes every engine still
    registered. atexit handlers run after non-daemon threads are joined and before the interpreter
    stops daemon threads, so `close()` can still end the requests in flight (CANCELLED), drain the
    steps on the device and join both threads while the interpreter is whole.
    The engine's own threads keep it reachable, so an engine whose owner was dropped without
    `close()` (a notebook cell that runs `model = foveal.load()` again) ran forever and kept its
    weights: +120 MB and two threads per reload of the embedded model. `close_with(owner, engine)`
    closes the engine once its owner (the `Model` users hold) is collected.
INVARIANTS
    - The registry holds engines weakly: registering never keeps an engine alive.
    - `close_with` never closes an engine on one of foveal's own threads (a close joins them): there
      it hands the close to a new thread.
    - At exit every registered engine is closed; one engine failing to close does not stop the
      others from closing.
    - Closing is idempotent (`Engine.close`), so an engine closed by its user needs no unregistering.
"""

from __future__ import annotations

import atexit
import threading
import traceback
import weakref
from typing import Protocol


class Closable(Protocol):
    def close(self) -> None: ...


_lock = threading.Lock()  # engines start on any thread; a WeakSet must not change while copied
_engines: weakref.WeakSet[Closable] = weakref.WeakSet()


def register(engine: Closable) -> None:
    """Close `engine` at interpreter exit unless it is gone (or closed, which makes that a no-op)."""
    with _lock:
        _engines.add(engine)


def open_engines() -> list[Closable]:
    """The registered engines still alive (closed ones included until they are collected)."""
    with _lock:
        return list(_engines)


def close_all() -> None:
    """Close every registered engine (the atexit handler; safe to call at any time)."""
    for engine in open_engines():
        try:
            engine.close()
        except Exception:  # exiting anyway: report, and still close the others
            traceback.print_exc()


atexit.register(close_all)


def close_with(owner: object, engine: Closable) -> None:
    """Close `engine` when `owner` is garbage collected (dropped without calling close())."""
    finalizer = weakref.finalize(owner, _close_from_any_thread, engine)
    finalizer.atexit = False  # at exit, close_all closes every engine anyway


def _close_from_any_thread(engine: Closable) -> None:
    # A collection runs on whichever thread triggers it, possibly the engine's own, which close()
    # would join: a deadlock. Non-daemon, so that the interpreter waits for it at exit.
    if threading.current_thread().name.startswith("foveal-"):
        threading.Thread(target=engine.close, name="close-dropped-engine").start()
    else:
        engine.close()
