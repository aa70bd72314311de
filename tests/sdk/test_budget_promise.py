"""The promise "a complete answer always fits", on the embedded model: detect and point size max_objects to
the token budget so that no spelling the grammar allows runs out of tokens mid-answer.

Under the mask a model may write the object phrase and the separator with more tokens than their
canonical tokenization (`" ; "` as three tokens, a label byte by byte); the budget is sized with
`grammars.spatial.item_token_bounds`, the worst case. Greedy decoding makes each call deterministic.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import foveal
from foveal.errors import IncompleteOutputError
from foveal.grammars import spatial

EMBEDDED = Path(foveal.__file__).parent / "embedded"
pytestmark = pytest.mark.skipif(
    not (EMBEDDED / "model.safetensors").is_file(),
    reason="no weights in sdk/embedded (export them with python -m foveal.training.train_shapes --run RUN "
    "--export sdk/embedded)",
)
SKILLS = ("detect", "point")


@pytest.fixture(scope="module")
def embedded():
    with foveal.load() as model:
        yield model


class Submissions:
    """Counts the requests a model hands its engine (a ValueError must come before any)."""

    def __init__(self, model) -> None:
        self.count = 0
        self._submit = model.engine.submit

    def __call__(self, request):
        self.count += 1
        return self._submit(request)


def _call(model, skill: str, image, phrase: str, settings_: dict | None):
    """The answer's items, or the ValueError the SDK raised before submitting any request."""
    submissions = Submissions(model)
    model.engine.submit = submissions
    try:
        result = getattr(model, skill)(image, phrase, settings=settings_)
    except ValueError as error:
        assert submissions.count == 0, f"{skill}({phrase!r}) raised {error!r} after decoding started"
        return error
    finally:
        del model.engine.submit
    assert result.usage.finish_reason == "stop"
    return result["objects" if skill == "detect" else "points"]


@pytest.mark.parametrize("skill", SKILLS)
def test_a_small_max_tokens_holds_fewer_items_or_is_refused(embedded, image, skill):
    """max_tokens=60 with "xyzzy": a complete answer with fewer objects (it raised IncompleteOutputError
    after 60 tokens), or a ValueError before decoding."""
    try:
        outcome = _call(embedded, skill, image, "xyzzy", {"max_tokens": 60})
    except IncompleteOutputError as error:
        pytest.fail(f"{skill} ran out of tokens mid-answer: {error}")
    if isinstance(outcome, ValueError):
        assert "max_tokens" in str(outcome)
    else:
        spec = getattr(embedded.family, skill)("xyzzy", 50).spec
        bounds = spatial.item_token_bounds(spec, embedded.family.tokenizer)
        assert len(outcome) <= bounds.items_within(60) < 50  # max_objects lowered to what 60 tokens hold


phrases = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=8)


@pytest.mark.slow  # each call decodes up to a few hundred tokens on CPU
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(phrase=phrases)
@example(phrase="ß")
@example(phrase="日本語")
@example(phrase="|||")
def test_default_settings_never_run_out_of_tokens(embedded, image, phrase):
    """Any phrase the SDK accepts: detect and point return a complete answer at default settings (these
    three phrases raised IncompleteOutputError), or refuse the phrase with a ValueError before decoding."""
    for skill in SKILLS:
        try:
            _call(embedded, skill, image, phrase, None)
        except IncompleteOutputError as error:
            pytest.fail(f"{skill}({phrase!r}) ran out of tokens mid-answer: {error}")
