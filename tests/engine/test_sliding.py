"""The sliding-window page pool (engine/sliding.py): a sequence holds only its window's pages.

Unit level: what `advance` releases and takes, the hold limit and the credit, the prefix lookup.
Engine level: FakeRunner(window=w, sliding=True) reads the last w tokens through the sliding block
tables from a pool of its own, so a page released while still in the window fails the read or
changes the tokens; its outputs must equal those of the same runner without the pool (every page
kept), pipelined and blocking, with chunked prefill, jump-forward grammars, drafts, the prefix
cache, and a pool smaller than one sequence's context (pages must be reused to finish at all).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from foveal.engine import Engine, Request, SamplingParams
from foveal.engine.kv_cache import pages_needed, prefix_chain
from foveal.engine.lanes import Lanes
from foveal.engine.sliding import SlidingPages, hold_pages, span_pages
from foveal.testing import FakeRunner

PAGE = 4


def _seq(prompt_len: int, max_tokens: int, lane: int = 0, chain: list[bytes] = (), whole: bool = False):
    request = SimpleNamespace(prefill=object() if whole else None)
    return SimpleNamespace(
        id=lane, lane=lane, prompt_len=prompt_len, max_tokens=max_tokens, request=request,
        prefix_chain=list(chain), sliding=[], sliding_base=0, sliding_credit=0,
    )


def _pages(num_pages: int = 64, window: int = 6, chunk: int = 8, span: int = 4) -> SlidingPages:
    return SlidingPages(num_pages, PAGE, window, chunk, span, Lanes(4, 64, sliding=True).sliding_table)


def _held(seq) -> list[int]:
    return [i for i, page in enumerate(seq.sliding) if page >= 0 and i >= seq.sliding_base]


def test_a_launch_keeps_exactly_the_window_of_its_first_query():
    pages = _pages(window=6)
    seq = _seq(prompt_len=20, max_tokens=40)
    assert pages.admit(seq, 0, [])
    pages.advance(seq, 0, 7)  # a first chunk of 8: pages 0 and 1
    assert _held(seq) == [0, 1]
    pages.advance(seq, 8, 15)  # keys from 8 - 6 + 1 = 3 on: page 0 is passed
    assert seq.sliding_base == 0 and _held(seq) == [0, 1, 2, 3]  # position 3 is on page 0: kept
    pages.advance(seq, 16, 19)  # keys from 11 on: pages 0, 1 (positions 0..7) are passed
    assert _held(seq) == [2, 3, 4]
    assert pages.table[0, :5].tolist()[:2] == [-1, -1]
    for position in range(20, 60):  # decode, one position a launch
        pages.advance(seq, position, position)
        first = max(0, position - 6 + 1) // PAGE
        assert _held(seq) == list(range(first, position // PAGE + 1))
    assert len(_held(seq)) <= pages.hold_limit(seq, 0)


def test_the_hold_limit_and_credit_keep_the_pool_from_running_out():
    pages = _pages(num_pages=12, window=6, chunk=8, span=4)
    limit = hold_pages(20, 59, False, PAGE, 6, 8, 4)
    assert limit == span_pages(8, 6, PAGE) == (8 + 6 - 2) // PAGE + 2 == 5
    a, b, c = _seq(20, 40, lane=0), _seq(20, 40, lane=1), _seq(20, 40, lane=2)
    assert pages.admit(a, 0, []) and pages.admit(b, 0, [])
    assert not pages.admit(c, 0, [])  # 12 - 2 * 5 = 2 pages left, c may need 5
    for position in range(0, 59):
        pages.advance(a, position, position)
        pages.advance(b, position, position)
        assert pages.pool.num_free - pages.credit >= 2
    pages.release(a)
    assert pages.admit(c, 0, [])
    pages.release(b)
    pages.release(c)
    assert pages.pool.num_free == 12 and pages.credit == 0 and pages.idle


def test_a_short_sequence_holds_no_more_than_its_own_pages():
    assert hold_pages(3, 5, False, PAGE, 512, 512, 64) == pages_needed(5, PAGE) == 2


def test_released_prompt_pages_stay_findable_and_a_hit_needs_the_window_before_it():
    pages = _pages(window=6)
    prompt = list(range(1, 30))
    chain = prefix_chain(prompt, PAGE)  # 7 full pages
    seq = _seq(len(prompt), 4, chain=chain)
    assert pages.admit(seq, 0, [])
    for start in range(0, len(prompt), 8):
        pages.advance(seq, start, min(start + 7, len(prompt) - 1))
    pages.register(seq)  # the prompt's K/V is written: the pages still held are offered too
    pages.release(seq)
    # every full prompt page was registered (the passed ones when released), none is held now
    assert all(pages.pool.is_cached(d) for d in chain) and pages.pool.num_free == pages.pool.num_pages
    hit, window = pages.lookup(chain, 6)  # a hit of 6 pages needs positions 24 - 6 + 1 = 19 on: pages 4, 5
    assert hit == 6 and len(window) == 2
    pages.pool.free(window)
    pages.pool.allocate(pages.pool.num_pages)  # evicts every cached page
    assert pages.lookup(chain, 6) == (0, [])


# ---- through the engine ----------------------------------------------------------------------------


def _requests(seed: int, vocab: int, n: int = 10, shared: int = 0, long: bool = False) -> list[Request]:
    rng = random.Random(seed)
    stem = [rng.randrange(1, vocab) for _ in range(shared)]
    return [
        Request(
            stem + [rng.randrange(1, vocab) for _ in range(rng.randint(20, 60) if long else rng.randint(1, 12))],
            SamplingParams(max_tokens=rng.randint(1, 80), seed=rng.randrange(1 << 32)),
        )
        for _ in range(n)
    ]


def _tokens(outputs) -> list:
    return [(o.token_ids, o.finish_reason) for o in outputs]


@pytest.mark.parametrize("window", [1, 5, 9])
def test_outputs_equal_those_with_every_page_kept(h, window):
    make = lambda: _requests(window, h.VOCAB, long=True)  # noqa: E731
    kept, _ = h.run_both(make, {"window": window})
    piped, blocking = h.run_both(make, {"window": window, "sliding": True}, prefill_chunk=8)
    assert _tokens(piped) == _tokens(kept) and _tokens(blocking) == _tokens(kept)


def test_a_pool_smaller_than_one_context_is_reused_to_the_end(h):
    """24 pages of 4 tokens, and sequences of up to 140 positions: only released pages let them finish."""
    make = lambda: _requests(11, h.VOCAB, n=6, long=True)  # noqa: E731
    kept, _ = h.run_both(make, {"window": 5})
    assert max(len(r.prompt_ids) + r.sampling.max_tokens for r in make()) > 24 * PAGE
    piped, blocking = h.run_both(make, {"window": 5, "sliding": True}, prefill_chunk=8, sliding_pages=24)
    assert _tokens(piped) == _tokens(kept) and _tokens(blocking) == _tokens(kept)


def test_drafts_prefix_cache_and_grammars_with_the_pool(h, automata):
    def make():
        rng = random.Random(6)
        requests = _requests(3, h.VOCAB, n=8, shared=23)
        for i in range(6):
            automaton, _ = automata[i % len(automata)]
            prompt = [rng.randrange(1, h.VOCAB) for _ in range(rng.randint(1, 6))]
            requests.append(Request(prompt * 3, SamplingParams(max_tokens=40, seed=i), automaton.matcher()))
        return requests

    kept, _ = h.run_both(make, {"window": 1})
    piped, blocking = h.run_both(make, {"window": 1, "sliding": True}, prefill_chunk=8, speculative="ngram")
    assert _tokens(piped) == _tokens(kept) and _tokens(blocking) == _tokens(kept)


def test_prefix_hits_read_the_window_from_cached_pages(h):
    stem = list(range(1, 41))
    requests = lambda: [Request(stem + [50 + i], SamplingParams(max_tokens=12)) for i in range(3)]  # noqa: E731
    runner = FakeRunner(vocab_size=h.VOCAB, seed=1, window=5, sliding=True)
    with h.engine(True, runner, prefill_chunk=8) as eng:
        first = eng.generate(requests()[:1], timeout=60)
        rest = eng.generate(requests()[1:], timeout=60)
        assert eng.stats()["prefix_hit_rate"] > 0
    with h.engine(True, FakeRunner(vocab_size=h.VOCAB, seed=1, window=5), prefill_chunk=8) as eng:
        assert _tokens(eng.generate(requests(), timeout=60)) == _tokens(first + rest)


def test_releasing_a_page_still_in_the_window_breaks_the_outputs(h, monkeypatch):
    """The check above can fail: a pool that passes pages one page early gives other tokens (or a bad read)."""
    make = lambda: _requests(5, h.VOCAB, long=True)  # noqa: E731
    kept, _ = h.run_both(make, {"window": 9})
    early = lambda self, position: max(0, position - self.window + 1 + self.page_size) // self.page_size  # noqa: E731
    monkeypatch.setattr(SlidingPages, "_first_needed", early)
    runner = FakeRunner(vocab_size=h.VOCAB, seed=1, window=9, sliding=True)
    try:
        with h.engine(True, runner, prefill_chunk=8) as eng:
            broken = eng.generate(make(), timeout=60)
    except Exception:  # a read through a released (-1) entry
        return
    assert _tokens(broken) != _tokens(kept)


def test_sizes_and_refusals(h):
    runner = FakeRunner(vocab_size=h.VOCAB, window=5, sliding=True)
    with h.engine(True, runner) as eng:
        assert eng.config.sliding_pages is not None and eng.config.sliding_pages <= eng.config.num_pages
    with pytest.raises(ValueError, match="no sliding-window KV"):
        Engine(FakeRunner(vocab_size=h.VOCAB), None, h.config(True, sliding_pages=8))
    small = h.engine(True, FakeRunner(vocab_size=h.VOCAB, window=5, sliding=True), sliding_pages=3)
    with small as eng, pytest.raises(ValueError, match="raise sliding_pages"):
        eng.submit(Request(list(range(1, 40)), SamplingParams(max_tokens=60)))


def test_a_kv_budget_holds_more_sequences_with_the_pool():
    """Sliding tensors are 3/4 of the bytes here: a budget split for windows holds more whole
    sequences than one pool for every layer, and the sliding pool is the smaller one."""
    from dataclasses import dataclass

    import torch

    from foveal.engine import EngineConfig, limits

    @dataclass
    class Sizes:
        sliding_window: int | None
        max_positions: int | None = None
        device: torch.device = torch.device("cpu")

        def kv_bytes_per_token(self) -> int:
            return 1024

        def sliding_kv_bytes_per_token(self) -> int:
            return 768 if self.sliding_window else 0

    config = EngineConfig(max_batch=64, max_model_len=4096, kv_cache_bytes=1 << 27)
    kept = limits.resolve(config, Sizes(None))
    pooled = limits.resolve(config, Sizes(512))
    per_sequence = pages_needed(4096, config.page_size)
    assert kept.sliding_pages is None and pooled.sliding_pages < pooled.num_pages
    assert pooled.num_pages // per_sequence > kept.num_pages // per_sequence
    page = config.page_size
    assert pooled.num_pages * page * 256 + pooled.sliding_pages * page * 768 <= 1 << 27  # within the budget
