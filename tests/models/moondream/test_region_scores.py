"""Scores of Moondream's region answers (families/moondream/scores.py) on hand-made head distributions."""

from __future__ import annotations

import math

import pytest

from foveal.engine.request import TokenLogprob
from foveal.families.moondream import region
from foveal.families.moondream.scores import region_scores
from foveal.families.scores import Decoded

V, EOS = 100, 0  # a vocabulary of 100 tokens; value ids follow it


def coord(bin_: int) -> int:
    return region.coord_id(V, bin_)


def size(w_bin: int, h_bin: int) -> int:
    return region.size_id(V, w_bin, h_bin)


def step(value: int, *alternatives: tuple[int, float]) -> TokenLogprob:
    top = tuple((v, math.log(p)) for v, p in alternatives)
    return TokenLogprob(value, dict(top)[value], top)


def test_a_box_scores_going_on_times_its_heads_mass_near_the_chosen_values():
    # width 2 ** (920 / 1023 * 10 - 10) ~ 0.50: x within a quarter of it (~0.124, 127 bins) is near
    w_bin = h_bin = 920
    gate = step(coord(500), (coord(500), 0.4), (coord(560), 0.2), (coord(900), 0.2), (EOS, 0.2))
    y = step(coord(300), (coord(300), 0.7), (coord(310), 0.1), (coord(10), 0.2))
    wh = step(
        size(w_bin, h_bin), (size(w_bin, h_bin), 0.5), (size(w_bin + 5, h_bin), 0.3), (size(100, h_bin), 0.2)
    )
    decoded = Decoded([coord(500), coord(300), size(w_bin, h_bin)], [gate, y, wh], None)
    [score] = region_scores(decoded, with_size=True, vocab_size=V, eos_id=EOS)
    assert score == pytest.approx(0.8 * (0.6 / 0.8) * 0.8 * 0.8)


def test_points_and_the_stop_decision():
    first = step(coord(100), (coord(100), 0.9), (EOS, 0.1))
    second = step(coord(800), (coord(800), 0.5), (EOS, 0.5))
    y = step(coord(200), (coord(200), 1.0))
    decoded = Decoded([coord(100), coord(200), coord(800), coord(200)], [first, y, second, y], None)
    assert region_scores(decoded, with_size=False, vocab_size=V, eos_id=EOS) == pytest.approx([0.9, 0.5])


def test_a_region_step_without_its_distribution_is_refused():
    bare = TokenLogprob(coord(1), float("nan"), ())
    decoded = Decoded([coord(1), coord(2)], [bare, bare], None)
    with pytest.raises(ValueError, match="region heads' alternatives"):
        region_scores(decoded, with_size=False, vocab_size=V, eos_id=EOS)
