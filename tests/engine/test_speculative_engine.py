"""Speculative decoding through the Engine (threads, real device worker): the same outputs as without
drafts, pipelined and blocking, with the prefix cache, chunked prefill, stop strings, logprobs and
real grammars; every page back at idle (h.run_both checks it)."""

from __future__ import annotations

import random

import pytest

from foveal.engine import Engine, Request, SamplingParams
from foveal.testing import FakeRunner

REPEATING = {"window": 1}  # FakeRunner's logits follow the last token: text repeats, drafts get accepted


def _requests(seed: int, vocab: int, n: int = 10, shared: int = 0, **sampling) -> list[Request]:
    rng = random.Random(seed)
    stem = [rng.randrange(1, vocab) for _ in range(shared)]
    return [
        Request(
            stem + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 12))],
            SamplingParams(max_tokens=rng.randint(1, 48), seed=rng.randrange(1 << 32), **sampling),
        )
        for _ in range(n)
    ]


def _tokens(outputs) -> list:
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.4}, {"temperature": 0.8, "top_k": 5}], ids=["greedy", "T", "k"])
def test_drafts_change_no_token_in_either_mode(h, sampling):
    make = lambda: _requests(1, h.VOCAB, **sampling)  # noqa: E731
    plain, _ = h.run_both(make, REPEATING)
    piped, blocking = h.run_both(make, REPEATING, speculative="ngram")
    assert _tokens(piped) == _tokens(plain) and _tokens(blocking) == _tokens(plain)


def test_drafts_with_the_prefix_cache_and_chunked_prefill(h):
    make = lambda: _requests(2, h.VOCAB, n=12, shared=21)  # noqa: E731
    plain, _ = h.run_both(make, REPEATING, prefill_chunk=8)
    piped, blocking = h.run_both(make, REPEATING, prefill_chunk=8, speculative="ngram")
    assert _tokens(piped) == _tokens(plain) and _tokens(blocking) == _tokens(plain)


def test_stop_strings_inside_accepted_drafts(h, tokenizer):
    make = lambda: _requests(3, h.VOCAB, n=8)  # noqa: E731
    plain, _ = h.run_both(make, REPEATING, tokenizer)
    # stop at a piece of each answer's own text, so that it is hit inside a repeated (drafted) run
    stops = [o.text[len(o.text) // 2 : len(o.text) // 2 + 2] or "zz" for o in plain]

    def with_stops():
        return [
            Request(r.prompt_ids, SamplingParams(max_tokens=r.sampling.max_tokens, seed=r.sampling.seed, stop=(s,)))
            for r, s in zip(make(), stops, strict=True)
        ]

    plain, _ = h.run_both(with_stops, REPEATING, tokenizer)
    piped, blocking = h.run_both(with_stops, REPEATING, tokenizer, speculative="ngram")
    assert _tokens(piped) == _tokens(plain) and _tokens(blocking) == _tokens(plain)


def test_logprobs_of_verified_tokens_equal_decodings(h):
    make = lambda: _requests(4, h.VOCAB, logprobs=3, temperature=0.5)  # noqa: E731
    plain, _ = h.run_both(make, REPEATING)
    piped, blocking = h.run_both(make, REPEATING, speculative="ngram")
    for outputs in (piped, blocking):
        assert _tokens(outputs) == _tokens(plain)
        for a, b in zip(outputs, plain, strict=True):
            assert len(a.logprobs) == len(a.token_ids)
            assert [(p.token_id, round(p.logprob, 5), [i for i, _ in p.top]) for p in a.logprobs] == [
                (p.token_id, round(p.logprob, 5), [i for i, _ in p.top]) for p in b.logprobs
            ]


def test_real_grammars_with_drafts(h, automata):
    def make():
        rng = random.Random(6)
        requests = []
        for i in range(12):
            automaton, _ = automata[i % len(automata)]
            prompt = [rng.randrange(1, h.VOCAB) for _ in range(rng.randint(1, 6))]
            requests.append(Request(prompt * 3, SamplingParams(max_tokens=40, seed=i), automaton.matcher()))
        return requests

    plain, _ = h.run_both(make, REPEATING)
    piped, blocking = h.run_both(make, REPEATING, speculative="ngram")
    assert _tokens(piped) == _tokens(plain) and _tokens(blocking) == _tokens(plain)


def test_the_engine_counts_drafts(h):
    with h.engine(runner=FakeRunner(vocab_size=h.VOCAB, seed=1, window=1), speculative="ngram") as eng:
        eng.generate([Request([5, 6, 7], SamplingParams(max_tokens=40))], timeout=60)
        stats = eng.stats()["speculative"]
    assert stats["drafted"] >= stats["accepted"] > 0 and 0 < stats["rate"] <= 1


def test_a_runner_that_cannot_verify_is_refused_before_anything_runs(h):
    class LastOnly(FakeRunner):
        rows_share_pages = False

    with pytest.raises(ValueError, match="speculative=None"):
        Engine(LastOnly(vocab_size=h.VOCAB), None, h.config(True, speculative="ngram"))
