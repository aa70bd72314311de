"""Invariant 3: the mask for step t+1 is built from the matcher after committing t; every
constrained output is accepted by its grammar; unconstrained rows skip the mask."""

from __future__ import annotations

import random

import pytest

from foveal.engine import FinishReason, Request, SamplingParams
from foveal.testing import FakeRunner


def _options(seed: int, vocab: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 10))] for _ in range(n)]


@pytest.mark.parametrize("pipelined", [True, False])
def test_mask_comes_from_the_matcher_after_the_previous_commit(h, pipelined):
    matchers = [h.TrieMatcher(_options(i, h.VOCAB)) for i in range(20)]
    with h.engine(pipelined, FakeRunner(vocab_size=h.VOCAB, seed=1, jitter_s=0.002)) as eng:
        outs = eng.generate(
            [
                Request([i + 1], SamplingParams(max_tokens=30, temperature=1.0 if i % 2 else 0.0, seed=i), m)
                for i, m in enumerate(matchers)
            ]
        )
    for m, out in zip(matchers, outs, strict=True):
        # fill_mask for output index k ran when exactly k tokens had been committed: never stale,
        # and never for a zombie row (its matcher is terminated)
        assert m.mask_history == list(range(len(m.tokens)))
        assert out.finish_reason is FinishReason.STOP
        assert m.accepts(out.token_ids) and m.is_terminated()


def test_mask_overrides_the_model(h):
    """The grammar wins even where the model strongly prefers other tokens."""
    runner = FakeRunner(vocab_size=h.VOCAB, seed=1, boost={7: 50.0})  # the model always wants 7
    options = [[100, 101, 102], [100, 103]]
    with h.engine(runner=runner) as eng:
        free, constrained = eng.generate(
            [
                Request([1], SamplingParams(max_tokens=3, ignore_eos=True)),
                Request([1], SamplingParams(max_tokens=10), h.TrieMatcher(options)),
            ]
        )
    assert free.token_ids == [7, 7, 7]
    assert constrained.token_ids in options


def test_a_refused_token_fails_only_that_request(h):
    class Liar(h.TrieMatcher):
        def fill_mask(self, bitmask, row):  # allows everything, then refuses at commit
            bitmask[row] = -1

    with h.engine() as eng:
        bad, good = eng.generate(
            [
                Request([1], SamplingParams(max_tokens=5), Liar([[9, 9]])),
                Request([2], SamplingParams(max_tokens=5, ignore_eos=True)),
            ]
        )
        assert eng.wait_idle(5) and eng.free_pages() == eng.config.num_pages
    assert bad.finish_reason is FinishReason.ERROR and "refused" in bad.error
    assert good.finish_reason is FinishReason.LENGTH and len(good.token_ids) == 5


def test_batched_fill_masks_is_called_once_per_step(h):
    calls = []

    def fill(matchers, bitmask):
        calls.append(len(matchers))
        for row, m in enumerate(matchers):
            m.fill_mask(bitmask, row)

    with h.engine(fill_masks=fill) as eng:
        eng.generate(
            [
                Request([i + 1], SamplingParams(max_tokens=12), h.TrieMatcher(_options(i, h.VOCAB)))
                for i in range(6)
            ]
        )
        steps = eng.stats()["steps"]
    assert 0 < len(calls) <= steps and max(calls) > 1


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_mask_failure_at_finalize_fails_only_that_request_and_the_engine_keeps_serving(h, pipelined):
    runner = FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.001)
    with h.engine(pipelined, runner) as eng:
        broken = eng.submit(Request([1], SamplingParams(max_tokens=10, ignore_eos=True), h.FailingMatcher(3)))
        others = [eng.submit(Request([i + 2], SamplingParams(max_tokens=10, ignore_eos=True))) for i in range(3)]
        failed = broken.result(10)
        assert failed.finish_reason is FinishReason.ERROR and "mask limit" in failed.error
        assert all(o.result(10).finish_reason is FinishReason.LENGTH for o in others)
        later = eng.generate([Request([9], SamplingParams(max_tokens=4, ignore_eos=True))], timeout=10)
        assert later[0].finish_reason is FinishReason.LENGTH
        assert eng.wait_idle(5) and eng.free_pages() == eng.config.num_pages
