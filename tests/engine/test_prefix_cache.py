"""The prefix cache: full prompt pages shared by content (kv_cache.PagePool), outputs equal with and
without it (the fake runner's logits read the whole context back from the pages, so a wrong page
shows), under pipelining, cancels and pool pressure, with every page back at idle."""

from __future__ import annotations

import itertools
import random

import pytest

from foveal.engine import FinishReason, Request, SamplingParams
from foveal.engine.detokenizer import Detokenizer
from foveal.engine.kv_cache import PagePool, prefix_chain
from foveal.engine.matcher import fill_masks_each
from foveal.engine.pipeline import Pipeline
from foveal.engine.request import RequestHandle
from foveal.engine.sequence import Sequence
from foveal.testing import FakeRunner
from foveal.testing.manual_device import ManualDevice

VOCAB = 300
_ids = itertools.count()


# ---- the pool ------------------------------------------------------------------------------------------


def test_a_registered_page_is_shared_by_reference_and_kept_when_unreferenced():
    pool = PagePool(4, 2)
    chain = prefix_chain([1, 2, 3, 4, 5], 2)
    assert len(chain) == 2 and chain != prefix_chain([1, 2, 3, 9, 5], 2)[:2]
    first = pool.allocate(3)
    pool.register(first[0], chain[0])
    pool.register(first[1], chain[1])
    assert pool.lookup(chain) == first[:2]  # now held twice
    pool.free(first)
    assert pool.num_free == 2  # first[2] free; first[0:2] still held by the second holder
    pool.free(first[:2])
    assert pool.num_free == 4 and pool.num_cached == 2  # unreferenced, but still findable
    assert pool.lookup(chain) == first[:2]
    pool.free(first[:2])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(first[:1])


def test_lookup_stops_at_the_first_missing_page_and_eviction_takes_the_least_recent():
    pool = PagePool(3, 2)
    old, new = prefix_chain([1, 1, 2, 2], 2), prefix_chain([7, 7], 2)
    pages = pool.allocate(3)
    pool.register(pages[0], old[0])
    pool.register(pages[1], new[0])
    pool.free([pages[0]])  # unreferenced first: evicted first
    pool.free([pages[1]])
    assert pool.lookup([old[1]]) == []  # chains match from their start only
    pool.free([pages[2]])
    assert sorted(pool.allocate(2)) == sorted([pages[2], pages[0]])  # the free page, the least recent cached
    assert pool.lookup(old) == [] and pool.lookup(new) == [pages[1]]


def test_only_a_held_page_can_be_registered():
    pool = PagePool(2, 2)
    with pytest.raises(RuntimeError, match="not held"):
        pool.register(0, b"x")


# ---- the pipeline, stepped by hand -----------------------------------------------------------------------


def _pipeline(pipelined=True, num_pages=64):
    return Pipeline(
        FakeRunner(vocab_size=VOCAB, seed=1),
        ManualDevice(),
        pipelined=pipelined,
        max_batch=4,
        max_step_tokens=64,
        page_size=4,
        num_pages=num_pages,
        max_model_len=64,
        fill_masks=fill_masks_each,
        debug=True,
    )


def _add(pipe, prompt, max_tokens, seed=None, cache=True):
    """Admit a request as Engine.submit does (with its prefix chain when the cache is on)."""
    request_id = next(_ids)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0 if seed is not None else 0.0, seed=seed or 0)
    seq = Sequence(
        request_id, Request(prompt, sampling), RequestHandle(request_id, lambda _: None), seed or 0,
        frozenset(), Detokenizer(None),
    )
    if cache:
        seq.prefix_chain = prefix_chain(prompt, pipe.page_size)
    pipe.sequences.add(seq)
    return seq


def _run(pipe):
    while pipe.has_work():
        pipe.tick()
    assert pipe.pool.num_free == pipe.pool.num_pages and pipe.lanes.num_free == pipe.lanes.count


def test_a_later_request_skips_the_shared_prompt_pages_and_answers_the_same():
    document = list(range(10, 30))  # 20 tokens: 5 full pages
    outputs = {}
    for cache in (True, False):
        pipe = _pipeline()
        first = _add(pipe, document + [1], 6, cache=cache)
        _run(pipe)
        second = _add(pipe, document + [2, 3], 6, cache=cache)
        third = _add(pipe, document, 6, cache=cache)  # all cached but the last page: one page computed
        _run(pipe)
        outputs[cache] = [s.handle.result(0).token_ids for s in (first, second, third)]
        if cache:
            assert (first.num_cached, second.num_cached, third.num_cached) == (0, 20, 16)
            assert pipe.stats.cached_tokens == 36 and pipe.stats.prompt_tokens == 21 + 22 + 20
    assert outputs[True] == outputs[False]


def test_requests_sharing_a_prefix_that_arrive_together_compute_it_once():
    """The first writes the shared pages; the others wait for them (scheduler.SHARE_PAGES) and read
    them from the cache, with the answers of a run without the cache."""
    outputs = {}
    for cache in (True, False):
        pipe = _pipeline()
        same = [_add(pipe, list(range(40, 52)) + [i], 4, cache=cache) for i in range(3)]
        _run(pipe)
        outputs[cache] = [s.handle.result(0).token_ids for s in same]
        if cache:
            assert [s.num_cached for s in same] == [0, 12, 12]
    assert outputs[True] == outputs[False]
    pipe = _pipeline()
    short = [_add(pipe, list(range(40, 45)) + [i], 4) for i in range(3)]  # one shared page: not worth a wait
    pipe.tick()
    assert all(s.pages is not None for s in short)
    _run(pipe)


# ---- the threaded engine -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [True, False])
def test_cache_on_and_off_give_the_same_outputs_under_pressure_and_cancels(h, pipelined):
    rng = random.Random(4)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.choice([8, 13, 24]))] for _ in range(4)]
    workload = [
        (rng.choice(prefixes) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 5))], rng.randint(1, 12), i)
        for i in range(60)
    ]
    cancel = set(rng.sample(range(60), 10))
    results = {}
    for cache in (True, False):
        runner = FakeRunner(vocab_size=h.VOCAB, seed=1, delay_s=0.0005, boost={h.EOS: 1.0})
        with h.engine(pipelined, runner, num_pages=40, prefix_cache=cache) as eng:  # pool under pressure
            handles = [
                eng.submit(Request(prompt, SamplingParams(max_tokens=n, temperature=0.9, seed=seed)))
                for prompt, n, seed in workload
            ]
            for i in cancel:
                handles[i].cancel()
            outs = [handle.result(60) for handle in handles]
            assert eng.wait_idle(10) and eng.free_pages() == eng.config.num_pages
            stats = eng.stats()
        results[cache] = outs
        if cache:
            assert stats["cached_prompt_tokens"] > 0
    for i, (on, off) in enumerate(zip(results[True], results[False], strict=True)):
        if i in cancel or FinishReason.CANCELLED in (on.finish_reason, off.finish_reason):
            continue
        assert (on.token_ids, on.finish_reason) == (off.token_ids, off.finish_reason), i
