"""families.qwen_vl.grounding: Qwen-VL's native bbox_2d / point_2d answers; one test per invariant, plus conversions."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from foveal import grammars
from foveal.families.qwen_vl.grounding import GroundingSpec
from foveal.grammars.bitmask import allocate_bitmask, allowed_tokens
from foveal.grammars.errors import GrammarViolation, SchemaError
from foveal.grammars.scalars import int_range
from foveal.grammars.walk import random_walk

EOS = 2


@pytest.mark.parametrize(("lo", "hi"), [(0, 0), (0, 9), (1, 10), (0, 56), (31, 1000), (7, 1008), (99, 101)])
def test_int_range_matches_exactly_the_integers_in_range(lo, hi):
    """Invariant 3."""
    pattern = re.compile(int_range(lo, hi))
    for n in range(0, 1200):
        assert bool(pattern.fullmatch(str(n))) == (lo <= n <= hi), n
    assert not pattern.fullmatch("0" + str(max(lo, 1)))  # no leading zeros


SPECS = [
    GroundingSpec("boxes", max_objects=3, label="red circle", width=57, height=31),
    GroundingSpec("boxes", max_objects=2, label="car", width=1000, height=1000),
    GroundingSpec("points", max_objects=3, label="red circle", width=57, height=31),
]


def _check(spec: GroundingSpec, text: str) -> None:
    assert text.startswith("```json\n[") and text.endswith("]\n```"), text
    items = json.loads(text[len("```json") : -len("```")])
    assert len(items) <= spec.max_objects
    for item in items:
        assert item["label"] == spec.label
        if spec.kind == "boxes":
            x1, y1, x2, y2 = item["bbox_2d"]
            assert 0 <= x1 < x2 <= spec.width and 0 <= y1 < y2 <= spec.height, text
        else:
            x, y = item["point_2d"]
            assert 0 <= x <= spec.width and 0 <= y <= spec.height, text
    result = spec.parse_answer(text)
    values = [v for item in result["objects" if spec.kind == "boxes" else "points"] for v in item.values()]
    assert all(0.0 <= v <= 1.0 for v in values)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.width}")
def test_random_walks_emit_only_valid_answers(spec, tok):
    """Invariant 1: every walk under the mask ends in a parseable answer with ordered boxes, never at a dead end."""
    automaton = grammars.compile(spec, tok, eos_token_id=EOS)
    rng = np.random.default_rng(0)
    items = 0
    for _ in range(40):
        walk = random_walk(automaton, rng, max_tokens=400, pull=0.004)
        assert not walk.empty_mask and walk.terminated and not walk.limit, walk
        text = tok.decode(walk.tokens, skip_special_tokens=False)
        _check(spec, text)
        items += text.count('"label"')
    assert items >= 20  # the walks do write items, not just "[]"


def _commit_text(matcher, tok, text: str) -> None:
    for token in tok.encode(text, add_special_tokens=False).ids:
        matcher.commit(token)


def test_a_max_at_or_below_its_min_is_refused(tok):
    """Invariant 2: x2 <= x1 is refused at commit and masked out; the matcher is unchanged after a refusal."""
    spec = GroundingSpec("boxes", max_objects=2, label="car", width=57, height=31)
    automaton = grammars.compile(spec, tok, eos_token_id=EOS)
    matcher = automaton.matcher()
    _commit_text(matcher, tok, '```json\n[\n\t{"bbox_2d": [30, 5, ')
    before = allocate_bitmask(1, automaton.vocab_size)
    matcher.fill_mask(before, 0)
    allowed = {tok.id_to_token(int(t)) for t in allowed_tokens(before, 0)}
    assert {"3", "4", "5"} <= allowed and not allowed & {"0", "1", "2", "6", "7", "8", "9"}
    count = matcher.num_committed
    with pytest.raises(GrammarViolation, match="max must exceed"):
        matcher.commit(tok.token_to_id("2"))
    assert matcher.num_committed == count
    after = allocate_bitmask(1, automaton.vocab_size)
    matcher.fill_mask(after, 0)
    assert np.array_equal(before, after)
    matcher.commit(tok.token_to_id("3"))  # 3x: 31..39 fit (30, 57]
    mask = allocate_bitmask(1, automaton.vocab_size)
    matcher.fill_mask(mask, 0)
    allowed = {tok.id_to_token(int(t)) for t in allowed_tokens(mask, 0)}
    assert "0" not in allowed and "1" in allowed  # 30 is not above 30; 31 is
    matcher.rollback(1)
    again = allocate_bitmask(1, automaton.vocab_size)
    matcher.fill_mask(again, 0)
    assert np.array_equal(before, again)


def test_conversion_qwen2_5_absolute_pixels_of_the_resized_input():
    """Qwen2.5-VL: pixels of the resized input (a 1000 x 500 photo resized to 1008 x 504); fractions of it are
    fractions of the original: [252, 126, 756, 378] -> 0.25..0.75 -> (250, 125, 750, 375) in the original."""
    spec = GroundingSpec("boxes", label="car", width=1008, height=504)
    text = '```json\n[\n\t{"bbox_2d": [252, 126, 756, 378], "label": "car"}\n]\n```'
    (box,) = spec.parse_answer(text)["objects"]
    assert box == {"x_min": 0.25, "y_min": 0.25, "x_max": 0.75, "y_max": 0.75}
    original = [round(box[k] * size) for k, size in zip(box, (1000, 500, 1000, 500), strict=True)]
    assert original == [250, 125, 750, 375]
    points = GroundingSpec("points", label="car", width=1008, height=504)
    text = '```json\n[\n\t{"point_2d": [504, 63], "label": "car"}\n]\n```'
    assert points.parse_answer(text) == {"points": [{"x": 0.5, "y": 0.125}]}


def test_conversion_qwen3_relative_thousandths():
    """Qwen3-VL: 0..1000 whatever the image; [250, 400, 500, 800] on a 1920 x 1080 image is (480, 432, 960, 864)."""
    spec = GroundingSpec("boxes", label="car", width=1000, height=1000)
    text = '```json\n[\n\t{"bbox_2d": [250, 400, 500, 800], "label": "car"}\n]\n```'
    (box,) = spec.parse_answer(text)["objects"]
    assert box == {"x_min": 0.25, "y_min": 0.4, "x_max": 0.5, "y_max": 0.8}
    original = [round(box[k] * size) for k, size in zip(box, (1920, 1080, 1920, 1080), strict=True)]
    assert original == [480, 432, 960, 864]
    assert spec.parse_answer("```json\n[]\n```") == {"objects": []}


def test_an_unbound_spec_cannot_compile(tok):
    with pytest.raises(SchemaError, match="bind it to the image"):
        grammars.compile(GroundingSpec("boxes", label="car"), tok, eos_token_id=EOS)


def test_forced_tokens_stop_before_any_digit(tok):
    """Jump-forward: the fence and the label are forced, cut before a digit (llguidance does not know
    the bounds; here the label's own "2" loses its jump)."""
    spec = GroundingSpec("boxes", max_objects=2, label="car 2", width=57, height=31)
    automaton = grammars.compile(spec, tok, eos_token_id=EOS)
    matcher = automaton.matcher()
    assert tok.decode(matcher.forced_tokens()) == "```json\n["
    _commit_text(matcher, tok, '```json\n[\n\t{"bbox_2d": [30, 5, 31, 6]')
    assert tok.decode(matcher._ll.compute_ff_tokens()) == ', "label": "car 2'
    assert tok.decode(matcher.forced_tokens()) == ', "label": "car '


def test_a_one_unit_box_scale_is_refused_and_the_smallest_scale_never_dead_ends():
    """At width or height 1 every box coordinate has one value: llguidance forces the separator and the
    digit together and allows only a token that holds both, which the refinement refuses inside a box
    (a random walk with the embedded tokenizer met that dead end). Such a scale is refused; at 2 x 2
    with the same tokenizer, walks end in answers."""
    from pathlib import Path

    from tokenizers import Tokenizer

    import foveal

    for width, height in ((1, 5), (5, 1), (1, 1)):
        with pytest.raises(SchemaError, match="at least 2"):
            GroundingSpec("boxes", max_objects=1, label="0", width=width, height=height)
    GroundingSpec("points", max_objects=1, label="0", width=1, height=1)  # points have 0 and 1
    embedded = Tokenizer.from_file(str(Path(foveal.__file__).parent / "embedded" / "tokenizer.json"))
    spec = GroundingSpec("boxes", max_objects=1, label="0", width=2, height=2)
    automaton = grammars.compile(spec, embedded, eos_token_id=1)
    rng = np.random.default_rng(0)
    for _ in range(200):
        walk = random_walk(automaton, rng, max_tokens=200, pull=0.004)
        assert not walk.empty_mask and walk.terminated and not walk.limit, walk
        _check(spec, embedded.decode(walk.tokens, skip_special_tokens=False))
