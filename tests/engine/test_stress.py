"""Stress: many requests with random prompt and output lengths, stops, grammars and cancellations,
submitted from 4 threads; pipelined output must equal blocking output.

The default suite runs 200 requests; `-m slow` runs the 2,000-request version.
"""

from __future__ import annotations

import random
import threading

import pytest

from foveal import grammars
from foveal.engine import FinishReason, Request, SamplingParams
from foveal.testing import FakeRunner

THREADS = 4


def _make(i: int, vocab: int, automata) -> tuple[Request, bool]:
    """Request i (a pure function of i) and whether to cancel it after its first delta/token."""
    rng = random.Random(i)
    kind = rng.random()
    sampling = SamplingParams(
        max_tokens=rng.randint(1, 40),
        temperature=rng.choice([0.0, 0.7, 1.2]),
        top_k=rng.choice([0, 0, 8]),
        top_p=rng.choice([1.0, 1.0, 0.8]),
        seed=rng.randrange(1 << 32),
        stop=(rng.choice(["e", "th", " a"]),) if kind < 0.2 else (),
        stop_token_ids=(rng.randrange(1, vocab),) if 0.2 <= kind < 0.3 else (),
    )
    matcher = None
    if 0.3 <= kind < 0.55:  # a real foveal.grammars automaton (regexes, a JSON schema)
        matcher = automata[rng.randrange(len(automata))][0].matcher()
    prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 30))]
    return Request(prompt, sampling, matcher), rng.random() < 0.08


def _run(h, tokenizer, automata, n: int, pipelined: bool) -> dict[int, tuple]:
    runner = FakeRunner(vocab_size=h.VOCAB, seed=1, boost={h.EOS: 2.5}, jitter_s=0.0005)
    config = dict(max_batch=32, num_pages=400, page_size=8, debug=True, fill_masks=grammars.fill_masks)
    with h.engine(pipelined, runner, tokenizer, **config) as eng:
        results: dict[int, tuple] = {}
        lock = threading.Lock()

        def worker(k: int) -> None:
            handles = []
            for i in range(k, n, THREADS):
                request, cancel = _make(i, h.VOCAB, automata)
                handle = eng.submit(request)
                if cancel:
                    handle.cancel()
                handles.append((i, request, handle))
            for i, request, handle in handles:
                out = handle.result(120)
                with lock:
                    results[i] = (out, request, cancel)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert eng.wait_idle(10) and eng.free_pages() == eng.config.num_pages
        assert eng.lanes.num_free == eng.lanes.count
    return results


def _check(h, tokenizer, automata, n: int) -> None:
    piped = _run(h, tokenizer, automata, n, True)
    blocking = _run(h, tokenizer, automata, n, False)
    checks = {id(a): check for a, check in automata}
    assert len(piped) == len(blocking) == n
    reasons = set()
    for i in range(n):
        (a, request, _), (b, _, _) = piped[i], blocking[i]
        reasons.add(a.finish_reason)
        for out in (a, b):
            assert out.finish_reason is not FinishReason.ERROR, out.error
            assert len(out.token_ids) <= request.sampling.max_tokens
            if request.matcher is not None and out.finish_reason is FinishReason.STOP:
                assert checks[id(request.matcher.automaton)](out.text), out.text
        if FinishReason.CANCELLED in (a.finish_reason, b.finish_reason):
            # when the cancel lands depends on timing: the shorter output is a prefix of the longer
            short, long = sorted((a.token_ids, b.token_ids), key=len)
            assert long[: len(short)] == short
        else:
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), i
    assert {FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED} <= reasons


def test_stress_small(h, tokenizer, automata):
    _check(h, tokenizer, automata, 200)


@pytest.mark.slow
def test_stress_2000_requests_4_threads(h, tokenizer, automata):
    _check(h, tokenizer, automata, 2000)
