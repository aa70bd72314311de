"""Invariant 5: a slot's host buffers are never overwritten before commit has read them.

Debug mode poisons `sampled_host` after every read and the device-side copy checks the poison
before writing; delays injected on the scheduler side (hooks) and the device side (forward jitter)
move the race windows around.
"""

from __future__ import annotations

import random
import time

import pytest

from foveal.engine import FinishReason, Request, SamplingParams
from foveal.engine.slot import POISON, DecodeSlot
from foveal.testing import FakeRunner


def _workload(n: int = 40) -> list[Request]:
    rng = random.Random(3)
    return [
        Request(
            [rng.randrange(1, 200) for _ in range(rng.randint(1, 6))],
            SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.8, seed=i),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("scheduler_delay", [0.0, 0.003])
@pytest.mark.parametrize("device_jitter", [0.0, 0.003])
def test_poisoned_host_buffers_under_injected_delays(h, scheduler_delay, device_jitter):
    rng = random.Random(7)

    def hook(phase):
        if scheduler_delay:
            time.sleep(rng.uniform(0, scheduler_delay))

    outputs = []
    for pipelined in (True, False):
        runner = FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.001, jitter_s=device_jitter)
        with h.engine(pipelined, runner, debug_hook=hook, max_batch=8) as eng:
            outs = eng.generate(_workload(), timeout=60)
            assert all(o.finish_reason is not FinishReason.ERROR for o in outs)
            assert all(bool((s.sampled_host == POISON).all()) for s in eng.slots)
        outputs.append([o.token_ids for o in outs])
    assert outputs[0] == outputs[1]


def test_the_poison_check_catches_an_unread_overwrite(h, monkeypatch):
    """If commit stopped poisoning what it read, the device copy must notice (the check can fail)."""
    original = DecodeSlot.read_sampled

    def forgetful(self, n, debug):
        return original(self, n, debug=False)

    monkeypatch.setattr(DecodeSlot, "read_sampled", forgetful)
    with h.engine() as eng:
        outs = eng.generate([Request([1], SamplingParams(max_tokens=10, ignore_eos=True))], timeout=10)
    assert outs[0].finish_reason is FinishReason.ERROR
    assert "overwritten before commit read them" in outs[0].error


def test_a_slot_is_not_reused_while_its_step_is_in_flight(h):
    """The slot a launch takes was committed (FREE) in an earlier tick, in both modes."""
    states = []

    def hook(phase):
        if phase == "launch" and holder:
            eng = holder[0]
            states.append(eng.slots[eng.pipeline.step_number % 2].state.value)

    holder = []
    with h.engine(debug_hook=hook) as eng:
        holder.append(eng)
        eng.generate(_workload(10))
    assert states and set(states) == {"free"}
