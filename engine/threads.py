"""`ThreadChooser`: how many intra-op threads a CPU's small launches (decode) run on, chosen by timing them.

PROBLEM
    A decode launch of a few rows has little work per op. On a quiet machine it still finishes
    sooner on all of a CPU's cores than on one; on a shared machine whose other processes hold the
    cores, one of its OpenMP threads is preempted and every parallel op waits for it, so one thread
    is faster. Which count wins depends on the load, which changes while a process runs: no fixed
    count is right (docs/performance.md measures both sides).
SOLUTION
    Time the launches and move towards the faster count. Every timed launch runs on one `choice`
    (one thread at first) except during a burst: after `burst` timed launches and then every
    `period` launches, the next `burst` launches run on a neighbouring count (the next of 1, 2, 4,
    ... up to the device's count, alternately above and below). Launches of different query-token
    counts cost differently (a decode row, a verify step of 4, a forced run of 3), so times are
    kept per token count and compared only like for like: after a burst, for each token count
    that has launches in the burst and among the choice's latest `burst`, the ratio of their
    medians; the chooser moves to the neighbour where these ratios, weighted by their launches,
    average (geometrically) at least `margin` below 1. The launch after a change of count is not
    counted: it pays for resizing the thread pool. Probing must stay cheap where it loses: on an
    oversubscribed machine a launch on more threads than the free cores can take many times
    longer, so a burst ends at its first launch slower than `abort` times the choice's median of
    its token count (the warm-up launch: `abort` squared), and each lost burst doubles the period,
    up to `most_period`; a won burst puts it back to `period`. The engine's device worker calls
    `pick` as a forward starts and `observe` when it ends.
INVARIANTS
    - Every count returned is one of `counts`: 1, the powers of two below `most`, and `most`.
    - With `most == 1` nothing is ever probed: every launch gets 1.
    - A burst takes at most `burst + 1` launches, and after the first burst at least `period`
      launches run on the choice between two bursts (more after lost ones).
    - The choice changes only after a burst, and only to the burst's count when it was faster on
      the token counts both ran.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable


class ThreadChooser:
    def __init__(
        self,
        most: int,
        period: int = 256,
        burst: int = 5,
        margin: float = 0.03,
        abort: float = 1.5,
        most_period: int = 8192,
    ) -> None:
        if most < 1 or period < 1 or burst < 1:
            raise ValueError(f"ThreadChooser needs most, period and burst >= 1 (got {most}, {period}, {burst})")
        self.counts = sorted({1, most} | {1 << i for i in range(most.bit_length()) if 1 << i < most})
        self.period, self.burst, self.margin = period, burst, margin
        self.abort, self.most_period = abort, max(period, most_period)
        self.choice = self.counts[0]
        self.bursts = 0
        self._period = period  # launches on the choice before the next burst (after the first)
        self._launches = 0  # timed launches on the choice since the last burst ended
        self._probe: int | None = None
        self._probe_left = 0
        self._last: int | None = None  # the count the previous launch ran on
        self._upward = True  # which neighbour the next burst tries
        self._times: dict[tuple[Hashable, int], deque[float]] = {}  # (tokens, threads) -> latest seconds

    def pick(self) -> int:
        """The intra-op thread count for the next launch (whatever its size: one count for all)."""
        due = self._launches >= (self.burst if self.bursts == 0 else self._period)
        if self._probe is None and due and len(self.counts) > 1:
            self._probe = self._neighbour()
            self._probe_left = self.burst + 1  # the first launch on it warms the pool up, untimed
            for key in [key for key in self._times if key[1] == self._probe]:
                del self._times[key]
        return self.choice if self._probe is None else self._probe

    def observe(self, tokens: Hashable, threads: int, seconds: float) -> None:
        """Record that a launch of `tokens` query tokens (or another shape's key: a decode burst's
        (tokens, forwards), device.py) took `seconds` on `threads` threads."""
        warm = threads == self._last
        self._last = threads
        if warm:
            self._times.setdefault((tokens, threads), deque(maxlen=self.burst)).append(seconds)
        if threads == self._probe:
            self._probe_left -= 1
            held = self._times.get((tokens, self.choice))
            limit = self.abort if warm else self.abort**2
            if held and seconds > limit * statistics.median(held):
                self._end_burst(won=False)  # far slower: stop paying for it now
            elif self._probe_left == 0:
                self._end_burst(self._burst_won())
        elif threads == self.choice and warm:
            self._launches += 1

    def _burst_won(self) -> bool | None:
        """Whether the burst's count was faster on the token counts both ran (None: none in common)."""
        log_sum = weight = 0.0
        for (tokens, threads), tried in self._times.items():
            held = self._times.get((tokens, self.choice))
            if threads != self._probe or not held:
                continue
            log_sum += len(tried) * math.log(statistics.median(tried) / statistics.median(held))
            weight += len(tried)
        return None if weight == 0 else log_sum / weight < math.log(1.0 - self.margin)

    def _neighbour(self) -> int:
        index = self.counts.index(self.choice)
        above = self.counts[index + 1] if index + 1 < len(self.counts) else None
        below = self.counts[index - 1] if index > 0 else None
        first, second = (above, below) if self._upward else (below, above)
        self._upward = not self._upward
        chosen = first if first is not None else second
        assert chosen is not None  # two counts at least (pick's check)
        return chosen

    def _end_burst(self, won: bool | None) -> None:
        if won:
            assert self._probe is not None
            self.choice, self._period = self._probe, self.period
        elif won is False:
            self._period = min(2 * self._period, self.most_period)
        self._probe, self._launches, self.bursts = None, 0, self.bursts + 1
