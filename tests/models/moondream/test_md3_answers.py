"""Moondream 3's region gates (answers.RegionMatcher with gate_ids): the first gate is unmasked, every later
one allows exactly the coord and eos tokens; Moondream 2's gates stay unmasked."""

from __future__ import annotations

import torch

from foveal.families.moondream.answers import GATE, RegionMatcher
from foveal.families.moondream.region import coord_id

VOCAB, EOS, COORD = 1024, 0, 5


def allowed(matcher) -> set[int]:
    mask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    matcher.fill_mask(mask, 0)
    bits = mask[0].numpy().view("uint32")
    return {w * 32 + b for w in range(VOCAB // 32) for b in range(32) if bits[w] >> b & 1}


def test_later_gates_choose_coord_or_eos():
    matcher = RegionMatcher(False, 3, VOCAB, EOS, gate_ids=(COORD, EOS))
    assert len(allowed(matcher)) == VOCAB  # after the prompt: the full argmax
    matcher.commit(coord_id(VOCAB, 100))
    matcher.commit(coord_id(VOCAB, 200))
    assert matcher.step_kind() == GATE
    assert allowed(matcher) == {COORD, EOS}
    matcher.rollback(2)
    assert len(allowed(matcher)) == VOCAB


def test_moondream_2_gates_are_unmasked():
    matcher = RegionMatcher(False, 3, VOCAB, EOS)
    matcher.commit(coord_id(VOCAB, 100))
    matcher.commit(coord_id(VOCAB, 200))
    assert len(allowed(matcher)) == VOCAB
