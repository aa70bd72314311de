"""A small thread-safe LRU: the explicit caches of the grammar layer (automata, tokenizers).

PROBLEM: compiles run on many threads at once (the SDK calls `compile` without a lock of its own),
and a compile takes from a millisecond to the compile budget's worth (grammars/limits.py). A lock
held across a compile would make every caller wait for the slowest one; no lock lets a burst of
identical requests (32 callers asking for the same detect grammar) compile the same spec 32 times.
SOLUTION: `get_or_build(key, build)` builds each missing key once: the first caller builds it with
no lock held, callers of the same key that arrive meanwhile wait for that build and share its
result (or its exception), and callers of other keys are never delayed. The lock guards only the
mapping and the table of builds in flight, for a few dictionary operations at a time.
INVARIANTS (tests/grammars/test_budget.py):
1. At most one build of a key runs at a time; every caller of that build gets the same value.
2. A build that raises is not cached: its waiters get its exception, the next caller builds again.
3. No lock is held while a build runs, so builds of different keys run in parallel.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

V = TypeVar("V")


class LRUCache(Generic[V]):
    """Bounded mapping str -> V; the least recently used entry is dropped when full."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError("an LRU cache needs maxsize >= 1")
        self.maxsize = maxsize
        self._data: OrderedDict[str, V] = OrderedDict()
        self._building: dict[str, Future[V]] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> V | None:
        with self._lock:
            return self._lookup(key)

    def put(self, key: str, value: V) -> None:
        with self._lock:
            self._store(key, value)

    def get_or_build(self, key: str, build: Callable[[], V]) -> V:
        """The value of `key`, built by `build()` if missing, once however many threads ask (module
        docstring); a caller that finds a build in flight waits for it and shares its outcome."""
        with self._lock:
            value = self._lookup(key)
            if value is not None:
                return value
            pending = self._building.get(key)
            owner = pending is None
            if pending is None:
                pending = self._building[key] = Future()
        if not owner:
            return pending.result()  # the builder's value, or its exception raised here
        try:
            value = build()
        except BaseException as error:
            with self._lock:
                del self._building[key]
            pending.set_exception(error)
            raise
        with self._lock:
            self._store(key, value)
            del self._building[key]
        pending.set_result(value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def _lookup(self, key: str) -> V | None:
        value = self._data.get(key)
        if value is None:
            self.misses += 1
            return None
        self._data.move_to_end(key)
        self.hits += 1
        return value

    def _store(self, key: str, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)
