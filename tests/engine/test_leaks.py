"""Invariant 4: every KV page and slot is freed exactly once, after inflight_refs is 0; at idle
the pools are full. Covers abort mid-flight, finish and abort in one step, immediate reuse and
admission control when pages run out."""

from __future__ import annotations

import random
import threading
import time

import pytest

from foveal.engine import FinishReason, Request, SamplingParams
from foveal.engine.kv_cache import PagePool
from foveal.engine.slot import SlotState
from foveal.testing import FakeRunner


def _assert_idle_and_full(eng):
    assert eng.wait_idle(10)
    assert eng.free_pages() == eng.config.num_pages
    assert eng.lanes.num_free == eng.lanes.count
    assert all(s.state is SlotState.FREE for s in eng.slots)
    assert not eng.pipeline.sequences.live


def test_pool_refuses_a_double_free():
    pool = PagePool(4, 2)
    pages = pool.allocate(2)
    pool.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(pages[:1])


class CheckedHook:
    """A debug hook whose failures fail the test.

    The hook runs on the engine's thread: an assert there becomes an engine error (every request
    ends ERROR) that no test assertion sees, so a broken condition passed as an ignored ERROR. The
    wrapper records what the hook raised and lets the engine carry on; the test thread asserts
    `hook.failures == []` (see `assert_ok`).
    """

    def __init__(self, body) -> None:
        self.body = body
        self.failures: list[str] = []
        self.calls = 0

    def __call__(self, phase: str) -> None:
        self.calls += 1
        try:
            self.body(phase)
        except BaseException as error:  # reported by assert_ok on the test thread
            self.failures.append(f"{phase}: {type(error).__name__}: {error}")

    def assert_ok(self) -> None:
        assert self.calls, "the hook never ran"
        assert not self.failures, "the engine-thread hook failed:\n" + "\n".join(self.failures[:5])


class CountingPool:
    """Wraps the engine's pool: counts allocations and frees per page."""

    def __init__(self, pool: PagePool) -> None:
        self.pool, self.allocated, self.freed = pool, [], []
        alloc, free = pool.allocate, pool.free
        pool.allocate = lambda n: self.allocated.extend(p := alloc(n)) or p
        pool.free = lambda pages: (self.freed.extend(pages), free(pages))[1]


@pytest.mark.parametrize("pipelined", [True, False])
def test_abort_mid_flight_frees_everything_once(h, pipelined):
    runner = FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.002, jitter_s=0.002)
    with h.engine(pipelined, runner, max_batch=8) as eng:
        counter = CountingPool(eng.pool)
        rng = random.Random(0)
        handles = [
            eng.submit(
                Request([1 + i], SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.5, seed=i))
            )
            for i in range(40)
        ]
        for _ in range(25):  # cancel from another thread while steps are in flight
            time.sleep(rng.uniform(0, 0.004))
            rng.choice(handles).cancel()
        outs = [hd.result(30) for hd in handles]
        _assert_idle_and_full(eng)
    assert sorted(counter.allocated) == sorted(counter.freed)  # each page freed once per allocation
    reasons = {o.finish_reason for o in outs}
    assert FinishReason.CANCELLED in reasons and len(reasons) > 1


def test_finish_and_abort_in_the_same_step(h):
    """At the commit where A finishes by max_tokens, B (in the same step) is cancelled, and C is admitted."""
    state = {}

    def hook(phase):
        eng = state.get("eng")
        if phase == "commit" and eng is not None and eng.pipeline.stats.steps == 3 and "done" not in state:
            state["done"] = True
            state["b"].cancel()
            state["c"] = eng.submit(Request([9], SamplingParams(max_tokens=3, ignore_eos=True)))

    checked = CheckedHook(hook)
    with h.engine(debug_hook=checked) as eng:
        a = eng.submit(Request([1], SamplingParams(max_tokens=3, ignore_eos=True)))
        state["b"] = eng.submit(Request([2], SamplingParams(max_tokens=50, ignore_eos=True)))
        state["eng"] = eng
        assert a.result(10).finish_reason is FinishReason.LENGTH
        assert state["b"].result(10).finish_reason is FinishReason.CANCELLED
        checked.assert_ok()
        assert state["c"].result(10).finish_reason is FinishReason.LENGTH
        _assert_idle_and_full(eng)


def test_zombie_pages_wait_for_the_step_in_flight(h):
    """A sequence that finished at commit t keeps its pages until step t+1 (its zombie) is committed."""
    seen = []

    def hook(phase):
        eng = seen[0] if seen else None
        if eng is not None and phase == "commit":
            for slot in eng.slots:
                if slot.step is not None:
                    for seq in slot.step.rows:
                        if seq.finalized:
                            assert not seq.released and seq.inflight_refs > 0
                            seen.append(seq.id)

    kw = {"vocab_size": h.VOCAB, "seed": 1, "boost": {h.EOS: 3.0}}
    checked = CheckedHook(hook)
    with h.engine(True, FakeRunner(**kw), debug_hook=checked) as eng:
        seen.append(eng)
        outs = eng.generate([Request([11 + i, 12], SamplingParams(max_tokens=100)) for i in range(10)])
        _assert_idle_and_full(eng)
    checked.assert_ok()
    assert all(o.finish_reason is not FinishReason.ERROR for o in outs)
    assert len(seen) > 1, "some step should have carried a zombie"


def test_immediate_page_reuse_gives_the_same_output(h):
    """With a pool that holds one request at a time, pages are reused at once and nothing leaks in."""
    reqs = lambda: [Request([1 + i, 2], SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(6)]  # noqa: E731
    with h.engine(num_pages=3, page_size=4) as eng:
        counter = CountingPool(eng.pool)
        small = eng.generate(reqs(), timeout=30)
        _assert_idle_and_full(eng)
    with h.engine() as eng:
        big = eng.generate(reqs(), timeout=30)
    assert [o.token_ids for o in small] == [o.token_ids for o in big]
    assert len(set(counter.allocated)) <= 3 and len(counter.allocated) == 18


def test_admission_waits_when_pages_run_out(h):
    running_max = []

    def hook(phase):
        if phase == "launch" and seen:
            running_max.append(len(seen[0].pipeline.scheduler.running))

    seen = []
    checked = CheckedHook(hook)
    with h.engine(num_pages=10, page_size=4, debug_hook=checked) as eng:  # 2 requests' worth of pages
        seen.append(eng)
        outs = eng.generate(
            [Request([i + 1] * 5, SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(8)]
        )
        _assert_idle_and_full(eng)
    checked.assert_ok()
    assert all(len(o.token_ids) == 12 for o in outs)
    assert max(running_max) == 2


def test_requests_the_engine_can_never_run_are_refused_at_submit(h):
    with h.engine(num_pages=4, page_size=4) as eng:
        with pytest.raises(ValueError, match="KV pages"):
            eng.submit(Request([1] * 10, SamplingParams(max_tokens=10)))
        with pytest.raises(ValueError, match="context of 256"):
            eng.submit(Request([1] * 300, SamplingParams(max_tokens=1)))
        with pytest.raises(ValueError, match="empty"):
            eng.submit(Request([], SamplingParams()))
        with pytest.raises(ValueError, match="stop strings need text"):
            eng.submit(Request([1], SamplingParams(max_tokens=2, stop=("x",))))
        with pytest.raises(ValueError, match="prompt_ids must be in"):
            eng.submit(Request([h.VOCAB], SamplingParams(max_tokens=2)))
        # the engine still works after refusing
        assert eng.generate([Request([1], SamplingParams(max_tokens=2, ignore_eos=True))])[0].token_ids


def test_many_threads_cancelling_and_submitting(h):
    with h.engine(runner=FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.001), max_batch=8) as eng:
        counter = CountingPool(eng.pool)
        results = []

        def worker(k):
            rng = random.Random(k)
            for i in range(15):
                hd = eng.submit(
                    Request([1 + i, k + 1], SamplingParams(max_tokens=rng.randint(1, 20), seed=i))
                )
                if rng.random() < 0.3:
                    hd.cancel()
                results.append(hd)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for hd in results:
            hd.result(30)
        _assert_idle_and_full(eng)
    assert sorted(counter.allocated) == sorted(counter.freed)
