"""The pipeline stepped by hand over a device that runs jobs only when waited on: every DESIGN
invariant checked at the tick where it must hold, with no thread, sleep or timing."""

from __future__ import annotations

import itertools
import random

import pytest

from foveal.engine.detokenizer import Detokenizer
from foveal.engine.matcher import fill_masks_each
from foveal.engine.pipeline import Pipeline
from foveal.engine.request import FinishReason, Request, RequestHandle, SamplingParams, seed_as_int64
from foveal.engine.sequence import Sequence
from foveal.engine.slot import SlotState
from foveal.testing import FakeRunner
from foveal.testing.manual_device import ManualDevice

EOS, VOCAB = 0, 300
_request_ids = itertools.count()


def make_pipeline(pipelined: bool = True, runner: FakeRunner | None = None, **sizes) -> Pipeline:
    config = dict(max_batch=4, max_step_tokens=64, page_size=4, num_pages=64, max_model_len=64)
    config.update(sizes)
    runner = runner or FakeRunner(vocab_size=VOCAB, seed=1)
    return Pipeline(runner, ManualDevice(), pipelined=pipelined, fill_masks=fill_masks_each, debug=True, **config)


def add(pipe: Pipeline, prompt: list[int], max_tokens: int, matcher=None, stop=(), seed=0, temperature=0.0):
    """Admit a request the way Engine.submit does (no EOS unless `stop` names it)."""
    request_id = next(_request_ids)
    sampling = SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature)
    handle = RequestHandle(request_id, lambda _: None)
    seq = Sequence(
        request_id, Request(prompt, sampling, matcher), handle, seed_as_int64(seed), frozenset(stop), Detokenizer(None)
    )
    pipe.sequences.add(seq)
    return seq


def run_to_idle(pipe: Pipeline, limit: int = 1000) -> int:
    ticks = 0
    while pipe.has_work():
        pipe.tick()
        ticks += 1
        assert ticks < limit, "the pipeline did not go idle"
    return ticks


def assert_greedy(runner: FakeRunner, seqs: list[Sequence]) -> None:
    """Every output token is the argmax of the runner's logits after its context, computed without a cache."""
    for seq in seqs:
        context = list(seq.request.prompt_ids)
        for token in seq.handle.result(0).token_ids:
            assert token == int(runner.reference_logits(context).argmax())
            context.append(token)


def assert_idle_and_free(pipe: Pipeline) -> None:
    assert not pipe.inflight and not pipe.sequences.live
    assert pipe.pool.num_free == pipe.pool.num_pages
    assert pipe.lanes.num_free == pipe.lanes.count
    assert all(slot.state is SlotState.FREE for slot in pipe.slots)


def test_a_tick_launches_the_next_forward_before_committing_the_last_step():
    pipe = make_pipeline()
    device = pipe.device
    seq = add(pipe, [5, 6, 7], max_tokens=4)
    pipe.tick()  # step 0: launched and finalized, nothing has run on the device yet
    assert device.log == [] and device.pending() == ["forward", "sample", "copy"]
    assert pipe.slots[0].state is SlotState.FINALIZED and seq.num_committed == 0
    pipe.tick()  # step 1 launched, then step 0 committed: its jobs ran, step 1's forward waits
    assert device.log == ["forward", "sample", "copy"]
    assert device.pending() == ["forward", "sample", "copy"]
    assert seq.num_committed == 1 and seq.num_scheduled == 2
    assert [step.number for step in pipe.inflight] == [1]


def test_blocking_mode_commits_right_after_finalize():
    pipe = make_pipeline(pipelined=False)
    seq = add(pipe, [5, 6, 7], max_tokens=4)
    for expected in range(1, 5):
        pipe.tick()
        assert not pipe.inflight and pipe.device.pending() == []
        assert seq.num_committed == expected
    assert seq.finish_reason is FinishReason.LENGTH
    assert_idle_and_free(pipe)


def test_a_slot_is_taken_only_after_commit_has_read_it():
    pipe = make_pipeline()
    add(pipe, [5], max_tokens=8)
    pipe.tick()
    pipe.launch()  # step 1 into slot 1, step 0 still unread in slot 0
    assert [slot.state for slot in pipe.slots] == [SlotState.FINALIZED, SlotState.LAUNCHED]
    with pytest.raises(AssertionError, match="reused before commit read it"):
        pipe.launch()


def test_every_launch_finds_its_slot_free_and_steps_alternate_slots():
    pipe = make_pipeline()
    for i in range(6):
        add(pipe, [i + 1, i + 2], max_tokens=3 + i)
    seen = []
    launch = pipe.launch

    def checked_launch():
        slot = pipe.slots[pipe.step_number % 2]
        seen.append((pipe.step_number, slot.index, slot.state))
        return launch()

    pipe.launch = checked_launch
    run_to_idle(pipe)
    assert seen and all(state is SlotState.FREE for _, _, state in seen)
    assert all(index == number % 2 for number, index, _ in seen)


def test_steps_commit_oldest_first_and_at_most_one_stays_in_flight():
    pipe = make_pipeline()
    for i in range(5):
        add(pipe, [i + 3], max_tokens=2 + 2 * i)
    committed = []
    commit = pipe.commit_oldest

    def recording_commit():
        committed.append(pipe.inflight[0].number)
        return commit()

    pipe.commit_oldest = recording_commit
    while pipe.has_work():
        pipe.tick()
        assert len(pipe.inflight) <= 1
    assert committed == list(range(pipe.step_number))


def test_a_sequence_is_never_launched_past_max_tokens():
    runner = FakeRunner(vocab_size=VOCAB, seed=1)
    pipe = make_pipeline(runner=runner)
    seq = add(pipe, [9, 9], max_tokens=3)
    launched = 0
    while pipe.has_work():
        before = pipe.step_number
        pipe.tick()
        launched += pipe.step_number - before
        assert seq.num_scheduled <= 3
    assert launched == 3 and runner.forwards == 3
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.token_ids) == 3


def test_a_zombie_rides_one_step_its_token_is_dropped_and_its_pages_wait_for_it():
    pipe = make_pipeline(runner=FakeRunner(vocab_size=VOCAB, seed=1, boost={EOS: 100.0}))
    seq = add(pipe, [4, 2], max_tokens=10, stop=(EOS,))
    pipe.tick()  # step 0
    pipe.tick()  # step 1 launched with the sequence; step 0 commits EOS: finished, but still in step 1
    assert seq.finalized and seq.finish_reason is FinishReason.STOP
    assert seq.inflight_refs == 1 and not seq.released
    assert pipe.pool.num_free < pipe.pool.num_pages  # its pages wait for step 1
    assert seq.handle.result(0).token_ids == []  # EOS is not output
    pipe.tick()  # nothing to launch; step 1 commits: the zombie's token is dropped, pages come back
    assert seq.inflight_refs == 0 and seq.released and seq.token_ids == []
    assert_idle_and_free(pipe)


def test_each_mask_is_built_after_the_previous_step_was_committed():
    class Counting:
        """A matcher allowing every token; records how many tokens it had at each mask."""

        def __init__(self):
            self.count, self.history = 0, []

        def commit(self, token_id):
            self.count += 1

        def fill_mask(self, bitmask, row):
            self.history.append(self.count)
            bitmask[row] = -1

        def is_terminated(self):
            return False

        def rollback(self, n):
            self.count -= n

    matchers = [Counting() for _ in range(3)]
    pipe = make_pipeline()
    for i, matcher in enumerate(matchers):
        add(pipe, [i + 1], max_tokens=5 + i, matcher=matcher)
    run_to_idle(pipe)
    for i, matcher in enumerate(matchers):
        assert matcher.history == list(range(5 + i))


def test_pages_are_freed_exactly_once_and_the_pools_are_full_at_idle():
    pipe = make_pipeline(runner=FakeRunner(vocab_size=VOCAB, seed=2, boost={EOS: 3.0}), num_pages=40)
    rng = random.Random(5)
    allocated = 0
    for _ in range(12):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 9))]
        seq = add(pipe, prompt, max_tokens=rng.randint(1, 12), stop=(EOS,), seed=rng.randrange(2**64), temperature=1.0)
        allocated += seq.pages_to_reserve(pipe.page_size)
    run_to_idle(pipe)
    assert pipe.pool.frees == allocated  # a second free of a page raises inside the pool
    assert_idle_and_free(pipe)


def test_pipelined_and_blocking_give_the_same_tokens():
    outputs = []
    for pipelined in (True, False):
        pipe = make_pipeline(pipelined, runner=FakeRunner(vocab_size=VOCAB, seed=3, boost={EOS: 2.0}))
        rng = random.Random(11)
        seqs = [
            add(pipe, [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))], rng.randint(1, 16),
                stop=(EOS,), seed=rng.randrange(2**64), temperature=rng.choice([0.0, 0.8]))
            for _ in range(10)
        ]
        run_to_idle(pipe)
        outputs.append([(s.handle.result(0).token_ids, s.finish_reason) for s in seqs])
        assert_idle_and_free(pipe)
    assert outputs[0] == outputs[1]


def test_cancel_finish_and_admission_in_one_step():
    pipe = make_pipeline(runner=FakeRunner(vocab_size=VOCAB, seed=1))
    long_one = add(pipe, [1, 2], max_tokens=20)
    short_one = add(pipe, [3], max_tokens=2)
    pipe.tick()
    pipe.tick()
    late = add(pipe, [7, 7], max_tokens=3)  # admitted in the tick where short_one finishes
    pipe.sequences.cancel(long_one.id)  # cancelled while a step carrying it is in flight
    assert long_one.finish_reason is FinishReason.CANCELLED
    assert long_one.inflight_refs == 1 and not long_one.released
    pipe.tick()  # launches without it, admits `late`; commits step 1: short_one ends, long_one's token dropped
    assert long_one.released and long_one.token_ids == long_one.handle.result(0).token_ids
    assert short_one.finish_reason is FinishReason.LENGTH
    run_to_idle(pipe)
    assert late.finish_reason is FinishReason.LENGTH and len(late.token_ids) == 3
    assert_idle_and_free(pipe)


def test_drain_with_steps_in_flight_ends_every_request_and_frees_everything():
    pipe = make_pipeline()
    seqs = [add(pipe, [i + 1], max_tokens=30) for i in range(4)]
    pipe.tick()
    pipe.tick()
    assert pipe.inflight
    pipe.drain(FinishReason.CANCELLED)
    assert all(s.handle.result(0).finish_reason is FinishReason.CANCELLED for s in seqs)
    assert_idle_and_free(pipe)


def test_a_matcher_failing_at_finalize_fails_only_its_request(h):
    pipe = make_pipeline()
    broken = add(pipe, [1], max_tokens=8, matcher=h.FailingMatcher(fail_at=3))
    healthy = add(pipe, [2], max_tokens=8, matcher=h.FailingMatcher(fail_at=99))
    plain = add(pipe, [3], max_tokens=8)
    run_to_idle(pipe)
    assert broken.finish_reason is FinishReason.ERROR and "mask limit" in broken.handle.result(0).error
    assert len(broken.token_ids) == 2  # the tokens committed before its mask failed
    assert healthy.finish_reason is FinishReason.LENGTH and plain.finish_reason is FinishReason.LENGTH
    assert_idle_and_free(pipe)
