"""The CPU device queue (engine/device.py): in-order work, copy events, errors that never hang."""

from __future__ import annotations

import threading
import time

import pytest

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
