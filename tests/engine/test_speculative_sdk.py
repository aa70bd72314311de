"""`foveal.load(speculative=...)`: the embedded model answers the same with drafts as without, and a
bad value is refused before anything loads."""

from __future__ import annotations

import pytest

import foveal
from foveal.vision import scenes


def test_the_embedded_model_answers_the_same_with_drafts():
    images = [scenes.render(scenes.generate_scene(seed)) for seed in range(3)]
    answers = {}
    for speculative in (None, "ngram"):
        with foveal.load(speculative=speculative) as model:
            assert model.engine.config.speculative == speculative
            answers[speculative] = [
                (model.caption(image, length="long")["caption"], model.detect(image, "circle")["objects"]) for image in images
            ]
            if speculative:
                assert model.engine.stats()["speculative"]["verify_rows"] > 0
    assert answers["ngram"] == answers[None]


def test_an_unknown_speculative_value_is_refused_before_loading():
    with pytest.raises(ValueError, match="'ngram'"):
        foveal.load("/nonexistent/folder", speculative="medusa")
