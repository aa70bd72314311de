"""`ThreadChooser`: how many intra-op threads a CPU's small launches (decode) run on, chosen by timing them.

PROBLEM
    A decode launch of a few rows has little work per op. On a quiet machine it still finishes
    sooner on all of a CPU's cores than on one; on a shared machine whose other processes hold the
    cores, one of its OpenMP threads is preempted and every parallel op waits for it, so one thread
    is faster. Which count wins depends on the load, which changes while a process runs: no fixed
    count is right (docs/performance.md measures both sides).
SOLUTION
    Time the launches and move towards the faster count. Launches are grouped by their query-token
    count, whose cost differs. Each group runs on its `choice` (at first one thread, or the choice
    of the nearest token count already seen: a 3-token jump starts where decode got to) and, after
    `burst` timed launches and then every `period` launches, runs a burst of up to `burst`
    launches on a neighbouring count (the next of 1, 2, 4, ... up to the device's count,
    alternately above and below). After the burst the chooser compares the median time of the
    burst with the median of the choice's latest `burst` launches, and moves to the neighbour where
    it is at least `margin` faster. The launch after a change of count is not counted: it pays for
    resizing the thread pool. Probing must stay cheap where it loses: on an oversubscribed machine
    a launch on more threads than the free cores can take many times longer, so a burst ends at
    its first launch slower than `abort` times the choice's median (the warm-up launch: `abort`
    squared), and each lost burst doubles the group's period, up to `most_period`; a won burst
    puts it back to `period`. The engine's device worker calls `pick` as a forward starts and
    `observe` when it ends.
INVARIANTS
    - Every count returned is one of `counts`: 1, the powers of two below `most`, and `most`.
    - With `most == 1` nothing is ever probed: every launch gets 1.
    - A burst takes at most `burst + 1` launches, and after the first burst a group makes at least
      `period` launches on its choice between two bursts (more after lost ones).
    - The choice changes only after a burst, and only to the burst's count when the burst was faster.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Group:
    """One query-token count's state: the count it runs on, and the burst it probes, if any."""

    choice: int
    launches: int = 0  # timed launches on `choice` since the last burst ended
    bursts: int = 0
    probe: int | None = None
    probe_left: int = 0
    last: int | None = None  # the count the group's previous launch ran on
    upward: bool = True  # which neighbour the next burst tries
    period: int = 0  # launches on `choice` before the next burst (after the first)
    times: dict[int, deque[float]] = field(default_factory=dict)


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
        self._groups: dict[int, _Group] = {}

    def pick(self, tokens: int) -> int:
        """The intra-op thread count for the next launch of `tokens` query tokens."""
        group = self._groups.get(tokens)
        if group is None:  # start where the nearest token count seen so far has got to
            nearest = min(self._groups.items(), key=lambda item: (abs(item[0] - tokens), item[0]), default=None)
            start = self.counts[0] if nearest is None else nearest[1].choice
            group = self._groups[tokens] = _Group(choice=start, period=self.period)
        due = group.launches >= (self.burst if group.bursts == 0 else group.period)
        if group.probe is None and due and len(self.counts) > 1:
            group.probe = self._neighbour(group)
            group.probe_left = self.burst + 1  # the first launch on it warms the pool up, untimed
            group.times.pop(group.probe, None)
        return group.choice if group.probe is None else group.probe

    def observe(self, tokens: int, threads: int, seconds: float) -> None:
        """Record that a launch of `tokens` query tokens took `seconds` on `threads` threads."""
        group = self._groups.get(tokens)
        if group is None:
            return  # not a launch `pick` chose (a fixed count, or before the chooser existed)
        warm = threads == group.last
        group.last = threads
        if warm:
            group.times.setdefault(threads, deque(maxlen=self.burst)).append(seconds)
        if threads == group.probe:
            group.probe_left -= 1
            held = group.times.get(group.choice)
            limit = self.abort if warm else self.abort**2
            if held and seconds > limit * statistics.median(held):
                self._end_burst(group, won=False)  # far slower: stop paying for it now
            elif group.probe_left == 0:
                tried = group.times.get(threads)
                won = bool(tried and held) and statistics.median(tried) < (1.0 - self.margin) * statistics.median(held)
                self._end_burst(group, won)
        elif threads == group.choice and warm:
            group.launches += 1

    def choices(self) -> dict[int, int]:
        """The count each query-token count seen so far runs on (engine stats)."""
        return {tokens: group.choice for tokens, group in sorted(self._groups.items())}

    def _neighbour(self, group: _Group) -> int:
        index = self.counts.index(group.choice)
        above = self.counts[index + 1] if index + 1 < len(self.counts) else None
        below = self.counts[index - 1] if index > 0 else None
        first, second = (above, below) if group.upward else (below, above)
        group.upward = not group.upward
        chosen = first if first is not None else second
        assert chosen is not None  # two counts at least (pick's check)
        return chosen

    def _end_burst(self, group: _Group, won: bool) -> None:
        if won:
            assert group.probe is not None
            group.choice, group.period = group.probe, self.period
        else:
            group.period = min(2 * group.period, self.most_period)
        group.probe, group.launches, group.bursts = None, 0, group.bursts + 1
