"""The prefix cache over image prompts (kv_cache.prefix_seed, step._past_the_cache, runner._image_inputs):
pages holding image tokens are shared only between prompts of the same image, the runner fills only
the image tokens past the cached pages (and runs no vision encoder when there are none), and greedy
outputs with the cache equal outputs without it, token for token and logit for logit (fp32)."""

from __future__ import annotations

import pytest
import torch

from foveal.engine import Engine, EngineConfig, Request, SamplingParams
from foveal.families import load
from foveal.testing import tiny
from tests.models.test_image_cache import count_encoder_calls

SHARED = "describe the image in one sentence and the quick brown fox jumps over the lazy dog"
QUESTIONS = ["a red circle", "how many shapes", "detect every green triangle", "point at the yellow star"]


def ask(loaded, cache: bool, prompts, first_alone: bool = True) -> tuple[list[list[int]], dict]:
    config = EngineConfig(max_batch=8, page_size=4, num_pages=256, prefix_cache=cache,
                          eos_token_ids=(), jump_forward=False)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    with Engine(loaded.runner, loaded.tokenizer, config) as engine:
        requests = [Request(p.token_ids, sampling, prefill=p.prefill) for p in prompts]
        outputs = engine.generate(requests[:1]) if first_alone else []
        outputs += engine.generate(requests[len(outputs):])
        return [o.token_ids for o in outputs], engine.stats()


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_one_image_many_questions_share_the_image_pages_and_skip_the_encoder(family, checkpoints):
    loaded = load(checkpoints[family], device="cpu", image_cache_bytes=0)  # only the prefix cache can skip it
    image = tiny.images(1)[0]
    prompts = [loaded.processor(f"{SHARED} {q}", image, image_key="image-a") for q in QUESTIONS]
    image_tokens = prompts[0].prefill.num_image_tokens
    calls = count_encoder_calls(loaded, family)
    cached, stats = ask(loaded, True, prompts)
    assert len(calls) == 1, "the vision encoder ran again for an image whose tokens the prefix cache held"
    assert stats["cached_prompt_tokens"] >= 3 * image_tokens
    calls.clear()
    plain, _ = ask(loaded, False, prompts)
    assert len(calls) == 2  # without the cache: the first request, then the other three in one call
    assert cached == plain


def spy_prefills(loaded) -> list[tuple[list, torch.Tensor]]:
    """(prefill inputs, logits) of every launch that prefills."""
    seen = []
    forward = loaded.runner.forward

    def spying(batch):
        logits = forward(batch)
        if batch.prefill:
            seen.append((list(batch.prefill), logits))
        return logits

    loaded.runner.forward = spying
    return seen


def test_a_page_boundary_inside_the_image_fills_only_its_uncached_tokens_with_the_same_logits(checkpoints):
    """Short prompts: the first page ends inside the image's tokens, so the second prompt's query
    starts mid-image and the runner scatters only the features past the cached ones."""
    loaded = load(checkpoints["llava"], device="cpu", image_cache_bytes=0)
    image = tiny.images(1)[0]
    prompts = [loaded.processor(q, image, image_key="image-a") for q in ("a", "red circle")]
    ids, count = prompts[0].token_ids, prompts[0].prefill.num_image_tokens
    start = ids.index(loaded.processor.image_token_id)
    assert start < 4 < start + count, "the tiny LLaVA's image tokens no longer straddle the first page"
    seen = spy_prefills(loaded)
    cached, stats = ask(loaded, True, prompts)
    assert stats["cached_prompt_tokens"] == 4
    assert seen[1][0][0].cached_image_tokens == 4 - start
    plain, _ = ask(loaded, False, prompts)
    assert cached == plain
    assert torch.allclose(seen[1][1], seen[3][1], atol=1e-5)  # the same logits as a full prefill


def test_different_images_never_share_pages(checkpoints):
    loaded = load(checkpoints["llava"], device="cpu")
    a, b = tiny.images(2)
    prompts = [loaded.processor(SHARED, a, image_key="image-a"), loaded.processor(SHARED, b, image_key="image-b")]
    assert prompts[0].token_ids == prompts[1].token_ids  # the placeholders say nothing of the pixels
    cached, stats = ask(loaded, True, prompts)
    assert stats["cached_prompt_tokens"] == 0
    assert cached == ask(loaded, False, prompts)[0]


def test_an_image_without_a_key_is_never_shared(checkpoints):
    loaded = load(checkpoints["llava"], device="cpu")
    image = tiny.images(1)[0]
    prompts = [loaded.processor(SHARED, image), loaded.processor(SHARED, image)]
    _, stats = ask(loaded, True, prompts)
    assert stats["cached_prompt_tokens"] == 0


def test_paligemma_shares_only_an_identical_bidirectional_prefix(checkpoints):
    """PaliGemma's prefix is attended both ways: a page's K/V depends on the prefix tokens after it,
    so another question on the same image shares nothing, the same question everything but the last page."""
    loaded = load(checkpoints["paligemma"], device="cpu", image_cache_bytes=0)
    image = tiny.images(1)[0]
    same = [loaded.processor(f"{SHARED} {QUESTIONS[0]}", image, image_key="image-a") for _ in range(2)]
    other = [loaded.processor(f"{SHARED} {q}", image, image_key="image-a") for q in QUESTIONS[:2]]
    cached, stats = ask(loaded, True, same)
    assert stats["cached_prompt_tokens"] > 0 and cached == ask(loaded, False, same)[0]
    cached, stats = ask(loaded, True, other)
    assert stats["cached_prompt_tokens"] == 0 and cached == ask(loaded, False, other)[0]
