"""Scores of Moondream's region answers: the same definition as every family's (foveal.families.scores), read
from the region heads' distributions instead of token alternatives.

A detect / point answer is a run of value ids (region.py): per object a gate step (eos ends the
answer, else the object's x is sampled), a coordinate step (y) and, for boxes, a size step (w, h).
The score of an object is

    (1 - P(eos) at its gate) x P(x near) x P(y near) [x P(size near)]

- P(eos) is the text distribution's at the gate; P(x near) is the coordinate head's mass within the
  tolerance of the chosen x, given going on (the gate's coordinate alternatives, divided by 1 - P(eos));
- the tolerance is scores.BOX_TOLERANCE of the box's own width (x) or height (y) for boxes,
  scores.POINT_TOLERANCE for points; a size alternative is near when its width and its height are both
  within BOX_TOLERANCE of the chosen ones, relatively.

CONTRACT with the runner (what `Decoded.logprobs` must hold at region steps): one `TokenLogprob` per
committed value id whose `top` lists (value id, logprob) alternatives of the head that sampled it:
at a gate step the eos id with the text distribution's log P(eos) and coordinate ids with
log((1 - P(eos)) * p_x(bin)); at a coordinate step coordinate ids with log p_y(bin); at a size step
size ids of (w, h) bin pairs with log p_w(w) + log p_h(h). A region step recorded without
alternatives (NaN logprob, empty `top`) cannot be scored: `region_scores` raises instead of guessing.
INVARIANTS (tests/models/moondream/test_region_scores.py): scores are in [0, 1], one per complete object.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from foveal.families.scores import BOX_TOLERANCE, POINT_TOLERANCE, Decoded

from .region import COORD_BINS, SIZE_BINS, value_of

SIZE_SCALE = 10.0  # sizes are 2 ** (bin / 1023 * 10 - 10), region.size_from_bins


def _size(bin_: int) -> float:
    return 2.0 ** (bin_ / (SIZE_BINS - 1) * SIZE_SCALE - SIZE_SCALE)


def _alternatives(decoded: Decoded, j: int) -> dict[int, float]:
    step = decoded.logprobs[j]
    if not step.top:
        raise ValueError(
            f"region step {j} was recorded without its head's distribution; the Moondream runner must record "
            "the region heads' alternatives (families/moondream/scores.py states what)"
        )
    found = dict(step.top)
    found.setdefault(step.token_id, step.logprob)
    return {v: lp for v, lp in found.items() if math.isfinite(lp)}


def _mass(probabilities: Iterable[tuple[int, float]], near) -> float:
    return sum(math.exp(lp) for value, lp in probabilities if near(value))


def region_scores(decoded: Decoded, with_size: bool, vocab_size: int, eos_id: int) -> list[float]:
    """A score per complete object of a region answer (boxes with_size, else points), in answer order."""
    ids = list(decoded.token_ids)
    if len(decoded.logprobs) != len(ids):
        raise ValueError(
            f"{len(ids)} values but {len(decoded.logprobs)} logprobs: ask the engine for logprobs"
        )
    per_object = 3 if with_size else 2
    scores = []
    for start in range(0, len(ids) - per_object + 1, per_object):
        kinds = [value_of(vocab_size, v) for v in ids[start : start + per_object]]
        if [k for k, _ in kinds] != ["coord", "coord", "size"][:per_object]:
            raise ValueError(f"values {ids[start : start + per_object]} are not one object's x, y[, size]")
        x, y = (bins[0] / COORD_BINS for _, bins in kinds[:2])
        w, h = (_size(b) for b in kinds[2][1]) if with_size else (None, None)
        tol_x = BOX_TOLERANCE * w if with_size else POINT_TOLERANCE
        tol_y = BOX_TOLERANCE * h if with_size else POINT_TOLERANCE
        gate = _alternatives(decoded, start)
        stop = math.exp(gate[eos_id]) if eos_id in gate else 0.0
        going = max(0.0, 1.0 - stop)
        x_near = _mass(((v, lp) for v, lp in gate.items() if v != eos_id), _coord_near(vocab_size, x, tol_x))
        score = going * (min(1.0, x_near / going) if going > 0 else 0.0)
        score *= min(1.0, _mass(_alternatives(decoded, start + 1).items(), _coord_near(vocab_size, y, tol_y)))
        if with_size:
            score *= min(1.0, _mass(_alternatives(decoded, start + 2).items(), _size_near(vocab_size, w, h)))
        scores.append(min(1.0, max(0.0, score)))
    return scores


def _coord_near(vocab_size: int, chosen: float, tolerance: float):
    def near(value_id: int) -> bool:
        kind, bins = value_of(vocab_size, value_id) if value_id >= vocab_size else ("token", ())
        return kind == "coord" and abs(bins[0] / COORD_BINS - chosen) <= tolerance + 1e-9

    return near


def _size_near(vocab_size: int, w: float, h: float):
    def near(value_id: int) -> bool:
        kind, bins = value_of(vocab_size, value_id) if value_id >= vocab_size else ("token", ())
        if kind != "size":
            return False
        w2, h2 = (_size(b) for b in bins)
        return abs(w2 - w) <= BOX_TOLERANCE * w + 1e-12 and abs(h2 - h) <= BOX_TOLERANCE * h + 1e-12

    return near

