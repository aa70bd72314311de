"""Constrained decoding with real `foveal.grammars` automata (llguidance) through the engine:
pipelined == blocking, masks built after the previous commit, every output accepted."""

from __future__ import annotations

import pytest

from foveal import grammars
from foveal.engine import FinishReason, Request, SamplingParams
from foveal.testing import FakeRunner


def _requests(automata, n: int = 24, record: bool = False):
    reqs, checks = [], []
    for i in range(n):
        automaton, check = automata[i % len(automata)]
        matcher = automaton.matcher()
        sampling = SamplingParams(max_tokens=60, temperature=0.0 if i % 3 == 0 else 1.0, seed=i)
        if i % 5 == 4:  # an unconstrained row in the same batch
            reqs.append(Request([i + 1, 3], sampling))
            checks.append(None)
            continue
        reqs.append(Request([i + 1, 3], sampling, matcher))
        checks.append(check)
    return reqs, checks


def test_real_grammars_pipelined_equals_blocking_and_accepts(h, tokenizer, automata):
    outputs = []
    for pipelined in (True, False):
        reqs, checks = _requests(automata)
        runner = FakeRunner(vocab_size=h.VOCAB, seed=1, jitter_s=0.001)
        with h.engine(pipelined, runner, tokenizer, fill_masks=grammars.fill_masks) as eng:
            outs = eng.generate(reqs, timeout=60)
            assert eng.wait_idle(5) and eng.free_pages() == eng.config.num_pages
        for out, check in zip(outs, checks, strict=True):
            if check is not None:
                assert out.finish_reason is FinishReason.STOP, out
                assert check(out.text), out.text
        outputs.append([(o.token_ids, o.text, o.finish_reason) for o in outs])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("pipelined", [True, False])
def test_real_masks_come_after_the_previous_commit(h, tokenizer, automata, pipelined):
    recs = [h.Recording(automata[i % len(automata)][0].matcher()) for i in range(12)]
    with h.engine(pipelined, FakeRunner(vocab_size=h.VOCAB, seed=1, jitter_s=0.002), tokenizer) as eng:
        outs = eng.generate(
            [
                Request([i + 1], SamplingParams(max_tokens=60, temperature=1.0, seed=i), r)
                for i, r in enumerate(recs)
            ]
        )
    for rec, out in zip(recs, outs, strict=True):
        assert out.finish_reason is FinishReason.STOP
        assert rec.history == list(range(rec.count))  # mask k built after exactly k commits; no zombie masks
