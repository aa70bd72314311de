"""The image-feature cache (engine/models/image_cache.py) and its use by the runner (runner.py).

Invariants of the cache: bounded bytes, LRU eviction refreshed by hits, one entry per key, off at 0.
Through the runner: a cached image is not encoded again, a hit gives the same logits as a miss, and
features never cross from one image to another.
"""

from dataclasses import replace

import pytest
import torch

import foveal
from foveal.engine.models import ImageFeatureCache, PromptInputs
from foveal.families import load
from foveal.testing import parity, tiny


def feats(rows: int, value: float = 0.0) -> torch.Tensor:
    return torch.full((rows, 4), value, dtype=torch.float32)  # rows * 16 bytes


# ---- the cache alone ---------------------------------------------------------------------------------------


def test_bytes_never_exceed_the_bound_and_eviction_is_least_recently_used():
    cache = ImageFeatureCache(max_bytes=3 * 16)
    cache.put("a", feats(1))
    cache.put("b", feats(1))
    cache.put("c", feats(1))
    assert cache.get("a") is not None  # refreshes a: b is now the oldest
    cache.put("d", feats(1))
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in ("a", "b", "c", "d") if k in cache}
    assert cache.bytes == 3 * 16 <= cache.max_bytes
    cache.put("e", feats(2))  # needs two slots: c and a go, in that order
    assert "c" not in cache and "a" not in cache and "d" in cache and "e" in cache
    assert cache.bytes == 3 * 16 and cache.stats.evictions == 3


def test_an_entry_larger_than_the_bound_is_not_stored_and_zero_turns_the_cache_off():
    cache = ImageFeatureCache(max_bytes=16)
    cache.put("small", feats(1))
    cache.put("big", feats(2))
    assert "big" not in cache and "small" in cache  # a too-big entry evicts nothing
    off = ImageFeatureCache(max_bytes=0)
    off.put("a", feats(1))
    assert len(off) == 0 and off.get("a") is None and off.stats.misses == 1


def test_one_key_one_entry_and_counts():
    cache = ImageFeatureCache(max_bytes=1024)
    cache.put("a", feats(1, 1.0))
    cache.put("a", feats(2, 2.0))  # replaced, not added
    assert len(cache) == 1 and cache.bytes == 32
    assert torch.equal(cache.get("a"), feats(2, 2.0))
    assert cache.get("b") is None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_resize_evicts_down_and_bad_sizes_raise():
    cache = ImageFeatureCache(max_bytes=1024)
    for key in "abcd":
        cache.put(key, feats(1))
    cache.resize(32)
    assert len(cache) == 2 and "c" in cache and "d" in cache
    for bad in (-1, 1.5, True, "64MiB"):
        with pytest.raises(ValueError, match="byte count"):
            ImageFeatureCache(bad)


# ---- through the runner ------------------------------------------------------------------------------------

VISION_MODULE = {"paligemma": "vision_tower", "llava": "vision_tower", "idefics3": "vision_model"}


def keyed(loaded, n: int, keys: list[str]) -> list[PromptInputs]:
    """n prompts over different images, each with its image_key as the SDK sets it."""
    prompts = tiny.family_prompts(loaded)[:n]
    return [
        PromptInputs(p.token_ids, replace(p.prefill, image_key=k)) for p, k in zip(prompts, keys, strict=True)
    ]


def count_encoder_calls(loaded, family: str) -> list[int]:
    """Images per vision-encoder call (one entry per call)."""
    calls: list[int] = []
    tower = getattr(loaded.runner.model.model, VISION_MODULE[family])
    tower.register_forward_hook(
        lambda _m, args, kwargs, _o: calls.append((args[0] if args else kwargs["pixel_values"]).shape[0]),
        with_kwargs=True,
    )
    return calls


@pytest.mark.parametrize("family", ["paligemma", "llava", "idefics3"])
def test_a_second_call_with_the_same_keys_does_not_run_the_vision_tower_and_gives_identical_results(
    family, checkpoints
):
    loaded = load(checkpoints[family], device="cpu")
    # every decode launch a replay, in both runs: a background trace that ends between them would make
    # the first run's decode eager and the second's a replay, which round apart (~1e-6)
    parity.trace_in_launch(loaded.runner)
    calls = count_encoder_calls(loaded, family)
    prompts = keyed(loaded, 3, ["k0", "k1", "k2"])
    miss = parity.greedy(loaded.runner, prompts, 4)
    assert len(calls) == 1  # the three misses, encoded in one call
    hit = parity.greedy(loaded.runner, prompts, 4)
    assert len(calls) == 1, "the second call re-encoded cached images"
    assert loaded.runner.image_cache.stats.hits == 3
    assert hit.tokens == miss.tokens
    for a, b in zip(hit.logits, miss.logits, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_hits_and_misses_mixed_in_one_launch_match_a_runner_without_cache(checkpoints):
    loaded = load(checkpoints["paligemma"], device="cpu")
    calls = count_encoder_calls(loaded, "paligemma")
    prompts = keyed(loaded, 5, [f"k{i}" for i in range(5)])
    parity.greedy(loaded.runner, prompts[:2], 1)  # caches k0, k1
    mixed = parity.greedy(loaded.runner, prompts, 6)
    assert calls == [2, 3]  # the second launch encoded only its three misses
    loaded.runner.image_cache.resize(0)
    uncached = parity.greedy(loaded.runner, prompts, 6)
    assert calls[-1] == 5
    assert mixed.tokens == uncached.tokens
    assert mixed.logits_close(uncached)


def test_one_image_twice_in_one_launch_is_encoded_once(checkpoints):
    """Concurrent calls on one image meet in one prefill launch: the image is encoded once for all."""
    loaded = load(checkpoints["paligemma"], device="cpu")
    calls = count_encoder_calls(loaded, "paligemma")
    image = tiny.images(1)[0]
    prompts = [loaded.processor(text, image) for text in tiny.PROMPTS[1:4]]
    same = [PromptInputs(p.token_ids, replace(p.prefill, image_key="same")) for p in prompts]
    shared = parity.greedy(loaded.runner, same, 4)
    assert calls == [1]
    unkeyed = parity.greedy(loaded.runner, prompts, 4)  # no keys: each encoded, as before the cache
    assert calls == [1, 3]
    assert shared.tokens == unkeyed.tokens
    assert shared.logits_close(unkeyed)


def test_the_runner_cache_stays_within_its_bound_and_evicts_the_least_recently_used(checkpoints):
    loaded = load(checkpoints["paligemma"], device="cpu")
    calls = count_encoder_calls(loaded, "paligemma")
    prompts = keyed(loaded, 3, ["k0", "k1", "k2"])
    parity.greedy(loaded.runner, prompts[:1], 1)
    one_image = loaded.runner.image_cache.bytes
    assert one_image > 0
    loaded.runner.image_cache.resize(2 * one_image)
    parity.greedy(loaded.runner, prompts[1:2], 1)
    parity.greedy(loaded.runner, prompts[0:1], 1)  # hit: k0 becomes the most recent, k1 the oldest
    parity.greedy(loaded.runner, prompts[2:3], 1)  # k2 evicts k1
    cache = loaded.runner.image_cache
    assert cache.bytes <= cache.max_bytes and len(cache) == 2
    assert "k1" not in cache and "k0" in cache and "k2" in cache
    parity.greedy(loaded.runner, prompts[1:2], 1)
    assert calls == [1, 1, 1, 1]  # k1 was encoded again after its eviction


def test_different_images_never_share_an_entry(checkpoints):
    loaded = load(checkpoints["llava"], device="cpu")
    prompts = keyed(loaded, 2, ["k0", "k1"])
    parity.greedy(loaded.runner, prompts, 1)
    cache = loaded.runner.image_cache
    assert len(cache) == 2
    assert not torch.equal(cache.get("k0"), cache.get("k1"))
    for key, prompt in zip(["k0", "k1"], prompts, strict=True):
        alone = loaded.runner.encode_images([prompt.prefill])[0]  # encoded alone: equal up to batch rounding
        assert torch.allclose(cache.get(key), alone, atol=1e-5)  # each entry holds its own image's features


def test_a_key_reused_for_an_image_of_another_token_count_raises(checkpoints):
    """Idefics3 splits images into a number of crops that depends on the size: 'k' cannot fit both."""
    loaded = load(checkpoints["idefics3"], device="cpu")
    prompts = tiny.family_prompts(loaded)[:3]
    first, other = sorted(prompts, key=lambda p: p.prefill.num_image_tokens)[::2]
    assert first.prefill.num_image_tokens != other.prefill.num_image_tokens
    parity.greedy(loaded.runner, [PromptInputs(first.token_ids, replace(first.prefill, image_key="k"))], 1)
    with pytest.raises(ValueError, match="image_key must identify one image"):
        parity.greedy(loaded.runner, [PromptInputs(other.token_ids, replace(other.prefill, image_key="k"))], 1)


def test_sdk_calls_on_one_image_encode_it_once(checkpoints):
    """End to end: the SDK's image_key reaches the runner; a second image gets its own entry."""
    a, b = tiny.images(2)
    with foveal.load(checkpoints["paligemma"], device="cpu", max_batch_size=4, max_model_len=128) as model:
        calls = count_encoder_calls(model.family, "paligemma")
        first = model.query(a, "red circle", settings={"max_tokens": 4})
        again = model.query(a, "red circle", settings={"max_tokens": 4})
        assert len(calls) == 1 and again == first
        model.query(b, "red circle", settings={"max_tokens": 4})
        assert len(calls) == 2 and len(model.family.runner.image_cache) == 2


def test_sdk_load_can_turn_the_cache_off(checkpoints):
    (a,) = tiny.images(1)
    with foveal.load(
        checkpoints["paligemma"], device="cpu", max_batch_size=4, max_model_len=128, image_cache_bytes=0,
        prefix_cache=False,  # the same prompt twice would else be served from the prefix cache's pages
    ) as model:
        calls = count_encoder_calls(model.family, "paligemma")
        first = model.query(a, "red circle", settings={"max_tokens": 4})
        again = model.query(a, "red circle", settings={"max_tokens": 4})
        assert len(calls) == 2 and again == first  # encoded each time, same answer
