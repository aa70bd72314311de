"""Lanes: per-sequence host arrays, written once at admission, that each step's staging gathers from.

PROBLEM
    Every step the scheduler thread writes each row's position, KV slot, block-table row, sampling
    parameters and the place of its input id into the slot's host buffers. Built row by row in
    Python that is a few microseconds per row per step, at a full batch a good part of a fast
    forward, host time the device waits for, and nearly all of it repeats the step before.
SOLUTION
    An admitted sequence takes a lane: an index into preallocated numpy arrays holding what does not
    change while it runs (prompt length, block-table row, temperature, top-p, top-k, seed, logprobs) and where
    its next input id is sampled (the step and row that last carried it). Staging a step is then a
    few numpy gathers by its rows' lanes, a cost that barely grows with the number of rows.
INVARIANTS
    - A sequence takes the lowest free lane.
    - A lane belongs to at most one sequence: taken at admission, given back at release (when no step
      in flight holds the sequence); giving back a free lane raises; at idle every lane is free.
    - `2 * max_batch` lanes always suffice, so admission never waits for one: when a step is scheduled
      at most one step is in flight, and every sequence holding a lane is a row of that step or of the
      step being scheduled (a running sequence that needs no more forwards still has a step in flight,
      and a finished one holds its lane only while a step in flight carries it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .request import SamplingParams


class Lanes:
    def __init__(self, count: int, max_pages: int, sliding: bool = False) -> None:
        self.count = count
        self.prompt_len = np.zeros(count, dtype=np.int64)
        self.block_table = np.full((count, max_pages), -1, dtype=np.int32)
        # the sliding-window layers' pages (sliding.py): changed by each launch, not only at admission
        self.sliding_table = np.full((count, max_pages), -1, dtype=np.int32) if sliding else None
        self.temperature = np.zeros(count, dtype=np.float32)
        self.top_p = np.ones(count, dtype=np.float32)
        self.top_k = np.zeros(count, dtype=np.int64)
        self.seed = np.zeros(count, dtype=np.int64)
        self.logprobs = np.full(count, -1, dtype=np.int64)  # alternatives to record; -1: none
        self.last_step = np.full(count, -1, dtype=np.int64)  # the latest step that carried the lane ...
        self.last_row = np.zeros(count, dtype=np.int64)  # ... and its row there (where its next input is)
        # a heap: the lowest free lane first, so the lanes in use stay few and low (a runner that
        # keeps a sequence per lane, runner.OwnsKV, attends over the range of lanes a launch spans)
        self._free = list(range(count))
        self._is_free = [True] * count

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(
        self,
        prompt_len: int,
        pages: list[int],
        sampling: SamplingParams,
        seed: int,
        sliding: Sequence[int] = (),
    ) -> int:
        """A lane for a sequence being admitted, with its fixed state written into it (and its
        sliding pages so far: those the prefix cache held)."""
        if not self._free:  # unreachable while the bound in the docstring holds
            raise RuntimeError(f"all {self.count} lanes are taken: a sequence was not released (engine bug)")
        lane = heapq.heappop(self._free)
        self._is_free[lane] = False
        self.prompt_len[lane] = prompt_len
        self.block_table[lane] = -1
        self.block_table[lane, : len(pages)] = pages
        if self.sliding_table is not None:
            self.sliding_table[lane] = -1
            self.sliding_table[lane, : len(sliding)] = sliding
        self.temperature[lane] = sampling.temperature
        self.top_p[lane] = sampling.top_p
        self.top_k[lane] = sampling.top_k
        self.seed[lane] = seed
        self.logprobs[lane] = -1 if sampling.logprobs is None else sampling.logprobs
        self.last_step[lane] = -1
        return lane

    def give_back(self, lane: int) -> None:
        if self._is_free[lane]:
            raise RuntimeError(f"lane {lane} given back twice")
        self._is_free[lane] = True
        heapq.heappush(self._free, lane)
