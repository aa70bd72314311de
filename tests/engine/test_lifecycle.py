"""Invariant 6: cancel, finish and admission in one step, shutdown with steps in flight, a
failing runner: no hang, no leak, every handle ends."""

from __future__ import annotations

import threading
import time

import pytest

from foveal.engine import FinishReason, Request, SamplingParams
from foveal.testing import FakeRunner


def test_shutdown_with_steps_in_flight_does_not_hang(h):
    runner = FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.02)
    with h.engine(runner=runner) as eng:
        handles = [
            eng.submit(Request([i + 1], SamplingParams(max_tokens=200, ignore_eos=True))) for i in range(8)
        ]
        while eng.pipeline.stats.steps < 3:
            time.sleep(0.005)
        assert eng.pipeline.inflight, "a step should be in flight"
        t0 = time.perf_counter()
        closer = threading.Thread(target=eng.close)
        closer.start()
        closer.join(5)
        assert not closer.is_alive(), "close() hung"
        assert time.perf_counter() - t0 < 2
        assert all(hd.result(1).finish_reason is FinishReason.CANCELLED for hd in handles)
        assert eng.free_pages() == eng.config.num_pages
        with pytest.raises(RuntimeError, match="closed"):
            eng.submit(Request([1], SamplingParams(max_tokens=2)))


def test_cancel_before_admission_and_after_finish(h):
    with h.engine(runner=FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.005), max_batch=1) as eng:
        first = eng.submit(Request([1], SamplingParams(max_tokens=5, ignore_eos=True)))
        queued = eng.submit(Request([2], SamplingParams(max_tokens=5, ignore_eos=True)))
        queued.cancel()  # still waiting for admission (max_batch=1)
        assert queued.result(5).finish_reason is FinishReason.CANCELLED
        assert first.result(5).finish_reason is FinishReason.LENGTH
        first.cancel()  # after finish: a no-op
        assert eng.wait_idle(5) and eng.free_pages() == eng.config.num_pages


def test_iterating_a_cancelled_handle_ends(h):
    with h.engine(runner=FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.002)) as eng:
        hd = eng.submit(Request([1], SamplingParams(max_tokens=200, ignore_eos=True)))
        threading.Timer(0.02, hd.cancel).start()
        deltas = list(hd)  # no tokenizer: no text, but the iteration must end
        assert deltas == [] and hd.result(1).finish_reason is FinishReason.CANCELLED
        assert 0 < len(hd.result().token_ids) < 200


class ExplodingRunner(FakeRunner):
    def forward(self, batch):
        if self.forwards >= 3:
            raise RuntimeError("boom")
        return super().forward(batch)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_failing_runner_ends_every_request(h, pipelined):
    eng_cm = h.engine(pipelined, ExplodingRunner(vocab_size=h.VOCAB, seed=1))
    with eng_cm as eng:
        handles = [
            eng.submit(Request([i + 1], SamplingParams(max_tokens=50, ignore_eos=True))) for i in range(4)
        ]
        outs = [hd.result(5) for hd in handles]
        assert all(o.finish_reason is FinishReason.ERROR and "boom" in o.error for o in outs)
        assert eng.wait_idle(5) and eng.free_pages() == eng.config.num_pages
        with pytest.raises(RuntimeError, match="failed"):
            eng.submit(Request([1], SamplingParams(max_tokens=2)))


def test_bad_sampling_params_are_refused_before_work():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="tuple of strings"):
        SamplingParams(stop="x")


def test_calls_arriving_together_on_an_idle_engine_are_prefilled_in_one_launch(h):
    """Issue 18: calls arriving a little apart (the SDK prepares them one at a time) were each
    admitted as they came. An idle engine now waits while arrivals keep coming (admission_window_s:
    a quiet window ends it) before its first launch, so they share one prefill."""
    import time

    runner = FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.02)
    # The window is far longer than any pause a loaded machine puts between two submits, and the
    # tenth arrival fills the batch, which ends the wait: the outcome does not depend on timing.
    with h.engine(runner=runner, max_batch=10, max_step_tokens=512, admission_window_s=5.0) as eng:
        handles = []
        for i in range(10):  # 0.5 ms apart, as an SDK preparing calls one at a time sends them
            handles.append(eng.submit(Request([i + 1] * 8, SamplingParams(max_tokens=4, ignore_eos=True))))
            time.sleep(0.0005)
        assert all(hd.result(10).finish_reason is FinishReason.LENGTH for hd in handles)
        stats = eng.stats()
    assert stats["prefill_rows"] == 10 and stats["prefill_steps"] == 1, stats["prefill_steps"]


def test_a_lone_request_is_not_held_past_the_admission_window(h):
    import time

    with h.engine(admission_window_s=0.05) as eng:
        started = time.perf_counter()
        eng.generate([Request([1], SamplingParams(max_tokens=1, ignore_eos=True))], timeout=10)
        assert time.perf_counter() - started < 4 * 0.05 + 0.5  # the window ends it, not the limit


def test_the_admission_window_defaults_by_device_and_refuses_nonsense(h):
    import torch

    from foveal.engine import limits

    with h.engine() as eng:  # a CPU runner, the window left unset
        assert eng.config.admission_window_s == limits.CPU_ADMISSION_WINDOW_S == 0.010
    assert limits._admission_window(None, torch.device("cuda")) == limits.ADMISSION_WINDOW_S == 0.002
    assert limits._admission_window(0, torch.device("cpu")) == 0.0  # 0: admit at once
    for bad in (-0.001, float("nan"), "5ms", True):
        with pytest.raises(ValueError, match="admission_window_s must be"):
            limits._admission_window(bad, torch.device("cpu"))
