"""The Scheduler alone: admission in FIFO order under the batch, token and page budgets, no row past
max_tokens, and release exactly once."""

from __future__ import annotations

import pytest

from foveal.engine.detokenizer import Detokenizer
from foveal.engine.kv_cache import PagePool
from foveal.engine.lanes import Lanes
from foveal.engine.request import PrefillInputs, Request, RequestHandle, SamplingParams
from foveal.engine.scheduler import Scheduler
from foveal.engine.sequence import Sequence


def make_scheduler(max_batch=4, max_step_tokens=32, num_pages=16, page_size=4, max_pages=8) -> Scheduler:
    return Scheduler(PagePool(num_pages, page_size), Lanes(2 * max_batch, max_pages), max_batch, max_step_tokens)


def waiting(scheduler: Scheduler, prompt_len: int, max_tokens: int, request_id: int = 0) -> Sequence:
    request = Request([1] * prompt_len, SamplingParams(max_tokens=max_tokens))
    seq = Sequence(request_id, request, RequestHandle(request_id, lambda _: None), 0, frozenset(), Detokenizer(None))
    scheduler.waiting.append(seq)
    return seq


def test_admits_in_fifo_order_up_to_max_batch():
    scheduler = make_scheduler(max_batch=2, num_pages=64)
    seqs = [waiting(scheduler, 2, 3, i) for i in range(3)]
    assert scheduler.schedule() == seqs[:2]
    assert list(scheduler.waiting) == seqs[2:]
    assert all(s.pages is not None and s.lane >= 0 for s in seqs[:2])


def test_admission_fits_running_rows_plus_prompt_chunks_in_the_token_budget():
    scheduler = make_scheduler(max_step_tokens=10, num_pages=64)
    first = waiting(scheduler, 8, 3, 0)
    second = waiting(scheduler, 8, 3, 1)
    assert scheduler.schedule() == [first, second] and (first.chunk, second.chunk) == (8, 2)  # 10 tokens
    first.num_prefilled, second.num_prefilled = 8, 2  # what the launch's staging does
    first.num_scheduled = 1
    assert scheduler.schedule() == [first, second] and second.chunk == 6  # 1 decode token + the rest


def test_a_long_text_prompt_is_prefilled_in_chunks_of_at_most_prefill_chunk():
    scheduler = Scheduler(PagePool(64, 4), Lanes(8, 16), 4, 32, prefill_chunk=8)
    seq = waiting(scheduler, 20, 3, 0)
    chunks = []
    while seq.num_prefilled < seq.prompt_len:
        assert scheduler.schedule() == [seq]
        chunks.append(seq.chunk)
        seq.num_prefilled += seq.chunk
    assert chunks == [8, 8, 4]


def test_a_prompt_with_prefill_inputs_is_never_split_and_waits_for_room():
    scheduler = make_scheduler(max_step_tokens=10, num_pages=64)
    running = waiting(scheduler, 4, 5, 0)
    assert scheduler.schedule() == [running]
    running.num_prefilled, running.num_scheduled = 4, 1
    request = Request([1] * 10, SamplingParams(max_tokens=2), prefill=PrefillInputs())
    image = Sequence(1, request, RequestHandle(1, lambda _: None), 0, frozenset(), Detokenizer(None))
    scheduler.waiting.append(image)
    assert scheduler.schedule() == [running]  # 1 + 10 > 10: it waits, whole
    running.num_scheduled, running.finalized = 5, True
    scheduler.remove(running)
    assert scheduler.schedule() == [image] and image.chunk == 10


def test_a_request_that_does_not_fit_the_free_pages_waits_at_the_head_of_the_line():
    scheduler = make_scheduler(num_pages=4, page_size=4)
    big = waiting(scheduler, 10, 7, 0)  # 16 positions: all 4 pages
    small = waiting(scheduler, 1, 1, 1)
    assert scheduler.schedule() == [big]
    assert scheduler.schedule() == [big] and list(scheduler.waiting) == [small]  # no page left
    big.num_scheduled, big.finalized = 7, True
    scheduler.remove(big)
    scheduler.release(big)
    assert scheduler.schedule() == [small]


def test_a_big_request_is_not_overtaken_by_smaller_ones_behind_it():
    scheduler = make_scheduler(num_pages=4, page_size=4)
    blocker = waiting(scheduler, 4, 5, 0)  # 2 pages
    scheduler.schedule()
    big = waiting(scheduler, 8, 5, 1)  # 3 pages: does not fit beside blocker
    small = waiting(scheduler, 1, 1, 2)  # would fit, but waits behind big
    assert scheduler.schedule() == [blocker]
    assert list(scheduler.waiting) == [big, small]


def test_a_running_sequence_is_not_scheduled_once_its_last_token_is_launched():
    scheduler = make_scheduler()
    seq = waiting(scheduler, 2, 2)
    assert scheduler.schedule() == [seq]
    seq.num_prefilled, seq.num_scheduled = 2, 1  # what the launch does
    assert scheduler.schedule() == [seq]
    seq.num_scheduled = 2
    assert scheduler.schedule() == [] and scheduler.has_work()


def test_pages_are_reserved_for_every_reachable_position():
    scheduler = make_scheduler(num_pages=16, page_size=4)
    seq = waiting(scheduler, 5, 4)  # positions 0..7 are fed back (the last output token never is)
    scheduler.schedule()
    assert len(seq.pages) == 2 and scheduler.pool.num_free == 14


def test_release_frees_pages_and_lane_once_and_only_when_finished():
    scheduler = make_scheduler()
    seq = waiting(scheduler, 3, 3)
    scheduler.schedule()
    with pytest.raises(AssertionError, match="bad release"):
        scheduler.release(seq)  # not finished
    seq.finalized = True
    scheduler.remove(seq)
    seq.inflight_refs = 1
    with pytest.raises(AssertionError, match="bad release"):
        scheduler.release(seq)  # a step in flight still carries it
    seq.inflight_refs = 0
    scheduler.release(seq)
    assert scheduler.pool.num_free == scheduler.pool.num_pages and scheduler.lanes.num_free == scheduler.lanes.count
    with pytest.raises(AssertionError, match="bad release"):
        scheduler.release(seq)
    assert not scheduler.has_work()


def test_remove_takes_a_sequence_out_of_the_queue_it_is_in():
    scheduler = make_scheduler(max_batch=1)
    running = waiting(scheduler, 1, 5, 0)
    queued = waiting(scheduler, 1, 5, 1)
    scheduler.schedule()
    scheduler.remove(queued)
    scheduler.remove(running)
    assert not scheduler.waiting and not scheduler.running
