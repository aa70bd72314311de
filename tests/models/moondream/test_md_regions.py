"""Moondream's answer automata, value ids, mask filling and region parsing (no checkpoint needed)."""

from __future__ import annotations

import pytest
import torch

from foveal.engine.regions import stage_kinds
from foveal.families.moondream.answers import COORD, GATE, SIZE, AnswerMatcher, RegionMatcher
from foveal.families.moondream.family import parse_regions
from foveal.families.moondream.region import coord_id, size_id, value_of

V, EOS = 1024, 0


def test_value_ids_round_trip():
    assert value_of(V, 17) == ("token", (17,))
    assert value_of(V, coord_id(V, 265)) == ("coord", (265,))
    assert value_of(V, size_id(V, 549, 654)) == ("size", (549, 654))
    assert value_of(V, size_id(V, 1023, 1023)) == ("size", (1023, 1023))
    with pytest.raises(ValueError):
        value_of(V, size_id(V, 1023, 1023) + 1)


def detect_answer(*objects):
    ids = []
    for x, y, w, h in objects:
        ids += [coord_id(V, x), coord_id(V, y), size_id(V, w, h)]
    return ids


def test_detect_automaton_kinds_and_max_objects():
    m = RegionMatcher(with_size=True, max_objects=2, vocab_size=V, eos_id=EOS)
    kinds = []
    for value in detect_answer((1, 2, 3, 4), (5, 6, 7, 8)):
        kinds.append(m.step_kind())
        assert not m.is_terminated()
        m.commit(value)
    assert kinds == [GATE, COORD, SIZE, GATE, COORD, SIZE]
    assert m.is_terminated()  # max_objects reached: no stop-or-continue step after the last object
    with pytest.raises(ValueError):
        m.commit(coord_id(V, 1))


def test_point_automaton_and_eos():
    m = RegionMatcher(with_size=False, max_objects=5, vocab_size=V, eos_id=EOS)
    for value in (coord_id(V, 1), coord_id(V, 2)):
        m.commit(value)
    assert m.step_kind() == GATE and not m.is_terminated()
    m.commit(EOS)
    assert m.is_terminated()


def test_automaton_refuses_wrong_kinds_and_rolls_back():
    m = RegionMatcher(with_size=True, max_objects=3, vocab_size=V, eos_id=EOS)
    with pytest.raises(ValueError, match="eos or an x"):
        m.commit(17)  # a token other than eos at a stop-or-continue step
    m.commit(coord_id(V, 1))
    with pytest.raises(ValueError, match="a y coordinate"):
        m.commit(size_id(V, 1, 1))
    m.commit(coord_id(V, 2))
    assert m.step_kind() == SIZE
    m.rollback(2)
    assert m.step_kind() == GATE and m.history == []


def test_answer_matcher_masks_answer_id_after_first_step():
    bitmask = torch.zeros(2, V // 32, dtype=torch.int32)
    m = AnswerMatcher(answer_id=3)
    m.fill_mask(bitmask, 0)
    assert (bitmask[0] == -1).all()
    m.commit(325)
    m.fill_mask(bitmask, 1)
    allowed = [(int(bitmask[1, t // 32]) >> (t % 32)) & 1 for t in range(V)]
    assert allowed[3] == 0 and sum(allowed) == V - 1
    m2 = AnswerMatcher(answer_id=31)  # the sign bit of an int32 word
    m2.commit(1)
    m2.fill_mask(bitmask, 0)
    assert int(bitmask[0, 0]) == 0x7FFFFFFF and int(bitmask[0, 1]) == -1


def test_stage_kinds_lists_region_rows():
    class Seq:
        def __init__(self, matcher, finalized=False):
            self.matcher, self.finalized = matcher, finalized
            self.step_kind = getattr(matcher, "step_kind", None)  # what submit resolves on a Sequence

    region = RegionMatcher(True, 3, V, EOS)
    region.commit(coord_id(V, 5))
    rows = [
        Seq(None),
        Seq(region),
        Seq(AnswerMatcher(3)),
        Seq(RegionMatcher(False, 1, V, EOS), finalized=True),
    ]
    kinds, listed = [9] * 4, [9] * 4
    assert stage_kinds(rows, kinds, listed) == 1
    assert kinds == [0, COORD, 0, 0] and listed[0] == 1


def test_parse_regions_follows_the_reference_arithmetic():
    text = "<coord 265><coord 948><size 549 654><coord 679><coord 4>"  # the last object is incomplete
    (box,) = parse_regions(text, with_size=True)
    x, y = 265 / 1024, 948 / 1024
    w = torch.pow(2.0, (torch.tensor(549.0) / 1023.0) * 10.0 - 10.0).item()
    h = torch.pow(2.0, (torch.tensor(654.0) / 1023.0) * 10.0 - 10.0).item()
    assert box == {"x_min": x - w / 2, "y_min": y - h / 2, "x_max": x + w / 2, "y_max": y + h / 2}
    assert box["x_min"] == 0.23864401504397392  # the fixture's recorded float
    points = parse_regions("<coord 4><coord 0>", with_size=False)
    assert points == [{"x": 4 / 1024, "y": 0.0}]
    (raw,) = parse_regions("<coord 679><coord 4><size 282 630>", with_size=True, clip=False)
    (clipped,) = parse_regions("<coord 679><coord 4><size 282 630>", with_size=True)
    assert raw["y_min"] < 0 and clipped["y_min"] == 0.0 and clipped["y_max"] == raw["y_max"]
