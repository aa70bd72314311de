"""PrefillInputs.cache_salt: prompts share prefix-cache pages only when their salts are equal."""

from __future__ import annotations

from foveal.engine.kv_cache import prefix_chain, prefix_seed
from foveal.engine.request import PrefillInputs

IDS = list(range(1, 33))


def _chain(prefill):
    return prefix_chain(IDS, 8, prefix_seed(IDS, prefill))


def test_a_salt_separates_text_only_and_image_prompts_and_equal_salts_share():
    text = [_chain(None), _chain(PrefillInputs()), _chain(PrefillInputs(cache_salt="a")),
            _chain(PrefillInputs(cache_salt="b"))]
    assert text[0] == text[1]  # no salt: as before
    assert len({tuple(c) for c in text[1:]}) == 3
    assert _chain(PrefillInputs(cache_salt="a")) == text[2]
    image = dict(num_image_tokens=4, image_key="img", image_token_id=7)
    plain, salted = _chain(PrefillInputs(**image)), _chain(PrefillInputs(**image, cache_salt="a"))
    assert not set(plain) & set(salted) and not set(salted) & set(text[2])
    assert _chain(PrefillInputs(**image, cache_salt="a")) == salted
