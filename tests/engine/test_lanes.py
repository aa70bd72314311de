"""Lanes (engine/lanes.py): per-sequence host arrays written at admission, one owner per lane,
and `2 * max_batch` of them are enough whatever the workload does."""

from __future__ import annotations

import random

import numpy as np
import pytest

from foveal.engine import FinishReason, Request, SamplingParams
from foveal.engine.kv_cache import PagePool
from foveal.engine.lanes import Lanes
from foveal.engine.scheduler import Scheduler
from foveal.testing import FakeRunner


def test_take_writes_the_fixed_state_and_give_back_twice_raises():
    lanes = Lanes(4, max_pages=5)
    lanes.block_table[:] = 77  # a previous owner's pages
    lane = lanes.take(9, [3, 1], SamplingParams(temperature=0.5, top_p=0.9, top_k=7), seed=123)
    assert lanes.prompt_len[lane] == 9
    assert lanes.block_table[lane].tolist() == [3, 1, -1, -1, -1]
    assert np.isclose(lanes.temperature[lane], 0.5) and np.isclose(lanes.top_p[lane], 0.9)
    assert lanes.top_k[lane] == 7 and lanes.seed[lane] == 123 and lanes.last_step[lane] == -1
    assert lanes.num_free == 3
    lanes.give_back(lane)
    with pytest.raises(RuntimeError, match="given back twice"):
        lanes.give_back(lane)


def test_a_sequence_takes_the_lowest_free_lane():
    """Lanes in use stay few and low: a runner that keeps a sequence per lane (runner.OwnsKV)
    attends over the range of lanes one launch spans."""
    lanes = Lanes(6, max_pages=2)
    taken = [lanes.take(1, [0], SamplingParams(), seed=0) for _ in range(4)]
    assert taken == [0, 1, 2, 3]
    lanes.give_back(2)
    lanes.give_back(0)
    assert lanes.take(1, [0], SamplingParams(), seed=0) == 0
    assert lanes.take(1, [0], SamplingParams(), seed=0) == 2
    assert lanes.take(1, [0], SamplingParams(), seed=0) == 4


def test_scheduler_refuses_fewer_lanes_than_the_bound():
    with pytest.raises(ValueError, match="2 \\* max_batch"):
        Scheduler(PagePool(8, 4), Lanes(7, 4), max_batch=4, max_step_tokens=64)


@pytest.mark.parametrize("pipelined", [True, False])
def test_two_lanes_per_row_suffice_under_churn(h, pipelined):
    """max_batch 2 (4 lanes): 1-token requests, EOS stops (zombies), cancellations and long
    requests side by side; a missing lane would fail the engine (every request ERROR)."""
    rng = random.Random(5)
    kw = {"vocab_size": h.VOCAB, "seed": 1, "boost": {h.EOS: 2.0}, "jitter_s": 0.001}
    with h.engine(pipelined, FakeRunner(**kw), max_batch=2) as eng:
        assert eng.lanes.count == 4
        handles = [
            eng.submit(Request([1 + i % 50], SamplingParams(max_tokens=rng.choice([1, 2, 5, 30]))))
            for i in range(60)
        ]
        for hd in rng.sample(handles, 10):
            hd.cancel()
        outs = [hd.result(30) for hd in handles]
        assert eng.wait_idle(10)
        assert eng.lanes.num_free == eng.lanes.count
    assert FinishReason.ERROR not in {o.finish_reason for o in outs}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= {o.finish_reason for o in outs}
