"""The read-ahead pipeline (batch/readahead.py invariants), with plain functions for read and call."""

from __future__ import annotations

import threading
import time

import pytest

from foveal.batch.readahead import pipeline


def _items(n):
    return [(f"k{i}", i) for i in range(n)]


def test_ordered_outcomes_one_per_item_with_failures_in_place():
    def call(x):
        if x % 7 == 3:
            raise ValueError(f"bad {x}")
        time.sleep(0.001 * (x % 5))  # finish out of order
        return x * 10

    outcomes = list(pipeline(_items(50), lambda s: s, call, window=8))
    assert [o.index for o in outcomes] == list(range(50))
    assert [o.key for o in outcomes] == [f"k{i}" for i in range(50)]
    for o in outcomes:
        assert (str(o.value) == f"bad {o.index}") if o.index % 7 == 3 else o.value == o.index * 10


def test_a_failed_read_is_that_items_outcome():
    def read(x):
        if x == 2:
            raise OSError("unreadable")
        return x

    outcomes = list(pipeline(_items(5), read, lambda x: x, window=2))
    assert [o.failed for o in outcomes] == [False, False, True, False, False]


def test_unordered_yields_every_item_once():
    outcomes = list(
        pipeline(_items(30), lambda s: s, lambda x: time.sleep(0.001 * (x % 3)) or x, window=6, ordered=False)
    )
    assert sorted(o.index for o in outcomes) == list(range(30))


def test_at_most_window_calls_in_flight_and_they_overlap():
    lock, current, peak = threading.Lock(), [0], [0]

    def call(x):
        with lock:
            current[0] += 1
            peak[0] = max(peak[0], current[0])
        time.sleep(0.01)
        with lock:
            current[0] -= 1
        return x

    assert len(list(pipeline(_items(40), lambda s: s, call, window=5))) == 40
    assert peak[0] == 5  # full, and never more


def test_fatal_errors_raise():
    def call(x):
        if x == 3:
            raise KeyboardInterrupt
        return x

    with pytest.raises(KeyboardInterrupt):
        list(pipeline(_items(10), lambda s: s, call, window=2, fatal=(KeyboardInterrupt,)))


def test_leaving_early_starts_nothing_more():
    started = []

    def call(x):
        started.append(x)
        time.sleep(0.005)
        return x

    run = pipeline(_items(1000), lambda s: s, call, window=4)
    assert next(run).index == 0
    run.close()
    time.sleep(0.05)
    assert len(started) <= 4 + 4 + 1  # the window, its refill after the first, and nothing after close
