"""The CPU device queue (engine/device.py): in-order work, copy events, errors that never hang."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from foveal.engine.device import CpuDevice
from foveal.engine.trace import Trace


def test_work_runs_in_order_and_a_copy_event_waits_for_it():
    device = CpuDevice(Trace())
    order = []
    gate = threading.Event()
    device.run("forward", lambda: (gate.wait(5), order.append("forward")))
    event = device.copy_to_host("copy", lambda: order.append("copy"))
    waited = threading.Thread(target=device.wait, args=(event,))
    waited.start()
    time.sleep(0.02)
    assert waited.is_alive() and order == []  # blocked behind the forward
    gate.set()
    waited.join(5)
    assert not waited.is_alive() and order == ["forward", "copy"]
    device.wait(event)  # waiting again on a done event returns at once
    assert device.job_n == {"forward": 1, "copy": 1}
    device.close()


def test_a_failed_job_is_raised_by_the_next_wait_and_later_events_still_end():
    device = CpuDevice(Trace())
    device.run("forward", lambda: 1 / 0)
    skipped = []
    event = device.copy_to_host("copy", lambda: skipped.append(1))
    with pytest.raises(RuntimeError, match="device work failed"):
        device.wait(event)
    with pytest.raises(RuntimeError, match="device work failed"):
        device.synchronize()  # no hang after a failure
    assert skipped == []  # work after the failure is not run
    device.close()


class _ThreadsSeen:
    """A runner wrapper that records the intra-op thread count each forward ran with."""

    def __init__(self, runner):
        self.runner, self.seen = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, batch):
        self.seen.append((int(batch.input_ids.shape[0]), torch.get_num_threads()))
        return self.runner.forward(batch)


def test_small_cpu_forwards_start_on_one_thread_and_put_the_count_back(h, two_threads):
    from foveal.engine import Request, SamplingParams
    from foveal.engine.device import SMALL_LAUNCH_TOKENS
    from foveal.testing import FakeRunner

    runner = _ThreadsSeen(FakeRunner(vocab_size=h.VOCAB, seed=1))
    with h.engine(runner=runner) as eng:
        eng.device.small_launch_threads = None  # timed (the suite fixes one thread: tests/conftest.py)
        assert eng.device.threads_for(SMALL_LAUNCH_TOKENS) == 2
        long_prompt = list(range(1, SMALL_LAUNCH_TOKENS + 3))
        eng.submit(Request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))).result(10)
        eng.device.synchronize()  # the last forward has ended
        assert torch.get_num_threads() == 2  # an idle engine leaves the process's count as it found it
    assert runner.seen[0] == (len(long_prompt), 2)  # the prefill: the process's count
    # batch-1 decode: one thread until the chooser's first burst (after `burst` timed launches)
    assert runner.seen[1:] and all(threads == 1 for _, threads in runner.seen[1:])


def test_small_cpu_forwards_take_the_devices_small_launch_threads(h, two_threads):
    """`CpuDevice.small_launch_threads` (benchmarks compare 1 and 2): decode forwards run on it."""
    from foveal.engine import Request, SamplingParams
    from foveal.testing import FakeRunner

    runner = _ThreadsSeen(FakeRunner(vocab_size=h.VOCAB, seed=1))
    with h.engine(runner=runner) as eng:
        eng.device.small_launch_threads = 2
        assert eng.device.threads_for(1) == 2
        eng.submit(Request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))).result(10)
    assert runner.seen and all(threads == 2 for _, threads in runner.seen)


class _SlowOnOneThread(_ThreadsSeen):
    """A runner whose forwards take 20 ms on one intra-op thread and 2 ms on more (a quiet machine)."""

    def forward(self, batch):
        time.sleep(0.020 if torch.get_num_threads() == 1 else 0.002)
        return super().forward(batch)


def test_decode_forwards_move_to_the_count_the_device_times_faster(h, two_threads):
    """The device's ThreadChooser times decode forwards where they run and moves them to 2 threads."""
    from foveal.engine import Request, SamplingParams
    from foveal.engine.threads import ThreadChooser
    from foveal.testing import FakeRunner

    runner = _SlowOnOneThread(FakeRunner(vocab_size=h.VOCAB, seed=1))
    with h.engine(runner=runner, decode_burst=1) as eng:  # one forward a launch: each of them timed
        eng.device.small_launch_threads = None  # timed (the suite fixes one thread: tests/conftest.py)
        eng.device.chooser = ThreadChooser(2, period=1000, burst=3)
        eng.submit(Request([1, 2, 3], SamplingParams(max_tokens=24, ignore_eos=True))).result(10)
        eng.device.synchronize()
        assert eng.stats()["decode_threads"] == 2
        assert torch.get_num_threads() == 2  # put back after each forward
    decode = [threads for _, threads in runner.seen[1:]]
    # the 3-token prefill warms the pool up (untimed), then the choice's three timed launches
    assert runner.seen[0][1] == 1 and decode[:3] == [1] * 3
    assert decode[-8:] == [2] * 8  # after the burst: the faster count, kept (no probe within 1000)


def test_foveal_decode_threads_fixes_the_small_launch_count(monkeypatch):
    from foveal.engine.device import decode_threads_from_env

    for value, expected in (("2", 2), ("1", 1), ("auto", None), ("", None)):
        monkeypatch.setenv("FOVEAL_DECODE_THREADS", value)
        assert decode_threads_from_env() == expected
        device = CpuDevice(Trace())
        assert device.small_launch_threads == expected
        device.close()
    monkeypatch.delenv("FOVEAL_DECODE_THREADS")
    assert decode_threads_from_env() is None
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("FOVEAL_DECODE_THREADS", bad)
        with pytest.raises(ValueError, match="FOVEAL_DECODE_THREADS must be a thread count >= 1 or 'auto'"):
            decode_threads_from_env()
