"""The interpreter's GIL switch interval while engines run, shared by every engine in the process.

PROBLEM
    A short `sys.setswitchinterval` lets the device thread get the GIL back quickly from Python
    bookkeeping, but the setting is process-wide. Each engine saving and restoring it on its own
    restores stale values when engines close out of order (open A, open B, close A, close B
    leaves B's "short" value in place forever).
SOLUTION
    Reference counting: the first engine to start saves the process's own interval and sets the
    shortest one asked for; the last engine to close restores the saved value.
INVARIANTS
    - While at least one engine runs, the interval is the smallest one any running engine asked for.
    - When none runs, the interval is what it was before the first one started.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()
_active: list[float] = []
_saved: float | None = None


def acquire(interval: float) -> None:
    global _saved
    with _lock:
        if not _active:
            _saved = sys.getswitchinterval()
        _active.append(interval)
        sys.setswitchinterval(min(_active))


def release(interval: float) -> None:
    global _saved
    with _lock:
        _active.remove(interval)
        if _active:
            sys.setswitchinterval(min(_active))
        elif _saved is not None:
            sys.setswitchinterval(_saved)
            _saved = None
