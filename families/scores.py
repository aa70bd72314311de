"""Scores of spatial answers: one definition for every family's boxes and points, and `Decoded`, what scorers read.

Every box and point carries `"score"` in [0, 1], read from the distributions its tokens were drawn
from under the grammar's mask (the engine's `TokenLogprob`s: the sampled token and its
`SCORE_ALTERNATIVES` most likely alternatives). An item's score is

    P(the answer went on to this item rather than stop) x prod over its coordinates of
    P(the coordinate lands within a tolerance of the value chosen)

- Going on: at each step between the previous item's last coordinate and this item's first one,
  the alternatives that would have ended the answer there (EOS where the answer may end, or a
  token whose text starts the answer's closing text and not the separator) take probability
  away from going on; their mass is removed, step by step.
- A coordinate's mass: for a location token, the probability of the location tokens within the
  tolerance of the chosen bin; for a coordinate written as digits (where, the spec says:
  `spec.coordinate_spans(text)`, foveal's JSON and a family's own format alike), the same at each of its
  tokens (and at the token that ends it), where an alternative's value is the number read with
  that one token replaced and the others kept, the product over its tokens.
- The tolerance is `BOX_TOLERANCE` (a quarter) of the box's own extent along the coordinate's
  axis: one edge moved that far keeps the box's IoU with the chosen one at 0.8 or more, so the
  mass measures how sure the model is of *this* box, at the scale of the box; a point's is
  `POINT_TOLERANCE` of the image. (Both chosen on scenes disjoint from those docs/scores.md
  reports: see there for what else was tried.)
Alternatives beyond the recorded ones count as neither stopping nor near: a score is a lower
bound of the quantity above when the distribution is wider than SCORE_ALTERNATIVES tokens.
The definition and its measured ranking are in docs/scores.md.
INVARIANTS (tests/sdk/test_scores.py)
- Every score is in [0, 1]; items and scores pair one to one, in answer order.
- Scoring reads the recorded distributions only: it never changes a sampled token.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from foveal.grammars import spatial
from foveal.grammars.locations import COORDINATES

if TYPE_CHECKING:
    from foveal.engine.request import TokenLogprob

SCORE_ALTERNATIVES = 20  # alternatives per token the scores read (the engine records at most 20)
BOX_TOLERANCE = 0.25  # of the box's extent along the coordinate's axis
POINT_TOLERANCE = 0.05  # of the image's side
# Scores are given to 4 decimals: the same answer decoded in another batch gets the same tokens but
# logits that differ in their last bits (batched matrix products), which moves a score by ~1e-6.
SCORE_DECIMALS = 4


@dataclass(frozen=True, slots=True)
class Decoded:
    """What a scorer reads of one constrained answer: its tokens, their logprobs (one per token), the
    tokenizer handle the grammar was compiled with (grammars.tokenizer), and the ids that end a sequence."""

    token_ids: Sequence[int]
    logprobs: Sequence[TokenLogprob]
    tokenizer: Any
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    def pieces(self) -> tuple[list[bytes], list[int], bytes]:
        """Each token's bytes (b"" for a special token), the byte offset where each starts (and the
        end), and the answer's whole text as bytes: what scorers locate coordinates in."""
        texts = self.tokenizer.token_bytes()
        pieces = [texts[t] if t < len(texts) else b"" for t in self.token_ids]
        starts = [0]
        for piece in pieces:
            starts.append(starts[-1] + len(piece))
        return pieces, starts, b"".join(pieces)


Scorer = Callable[[Decoded], list[float]]


def with_scores(items: list[dict], scores: Sequence[float], min_score: float = 0.0) -> list[dict]:
    """The items with their `"score"` to SCORE_DECIMALS, those below `min_score` left out (order kept)."""
    if len(items) != len(scores):
        raise ValueError(
            f"{len(items)} items but {len(scores)} scores: the scorer and the parser read the answer "
            "differently, please report it"
        )
    rounded = [round(score, SCORE_DECIMALS) for score in scores]
    return [{**item, "score": score} for item, score in zip(items, rounded, strict=True) if score >= min_score]


# ---- scores of spatial answers (module docstring) ----------------------------------------------------


@dataclass(slots=True)
class _Coordinate:
    """One coordinate of an answer: its value (normalized), its axis (0 x, 1 y), the steps that wrote
    it with the value each alternative there would have given, and the byte offset where it ends."""

    value: float
    axis: int
    steps: list[tuple[int, Callable[[int], float | None]]]
    end: int


def spatial_scores(spec: spatial.SpatialSpec, decoded: Decoded) -> list[float]:
    """A score per item of an answer of `spec` (loc, JSON or grounding encoding), in answer order."""
    if len(decoded.logprobs) != len(decoded.token_ids):
        raise ValueError(
            f"{len(decoded.token_ids)} tokens but {len(decoded.logprobs)} logprobs: ask the engine for them "
            f"(SamplingParams(logprobs={SCORE_ALTERNATIVES}))"
        )
    pieces, starts, text = decoded.pieces()
    texts = decoded.tokenizer.token_bytes()
    reader = _loc_coordinates if spec.encoding == "loc" else _text_coordinates
    coordinates = reader(spec, decoded, pieces, starts, text)
    per_item = COORDINATES[spec.kind]
    layout = spec.layout()
    tail, head = _item_tail(layout).encode(), _item_head(layout).encode()
    scores, previous_end, after = [], None, 0  # previous_end: byte offset where the previous item ended
    for k in range(len(coordinates) // per_item):
        item = coordinates[k * per_item : (k + 1) * per_item]
        if previous_end is None:
            stopped, going_on = layout.empty.encode(), layout.start.encode() + head
        else:
            stopped = text[:previous_end] + layout.end.encode()
            going_on = text[:previous_end] + layout.separator.encode() + head
        first = item[0].steps[0][0]
        going = 1.0
        for j in range(after, first + 1):
            going *= 1.0 - _stop_mass(decoded, j, texts, text[: starts[j]], stopped, going_on)
        mass = math.prod(_near_mass(decoded, c, _tolerance(spec, item, c)) for c in item)
        scores.append(min(1.0, max(0.0, going * mass)))
        previous_end, after = item[-1].end + len(tail), item[-1].steps[-1][0]
    return scores


def _item_tail(layout: spatial.AnswerLayout) -> str:
    """The fixed text of an item after its last coordinate."""
    tail = ""
    for piece in reversed(layout.item):
        if isinstance(piece, spatial.Coordinate):
            return tail
        tail = piece + tail
    return tail


def _item_head(layout: spatial.AnswerLayout) -> str:
    """The fixed text of an item before its first coordinate (what going on writes after the separator)."""
    head = ""
    for piece in layout.item:
        if isinstance(piece, spatial.Coordinate):
            return head
        head += piece
    return head


def _candidates(step: TokenLogprob) -> dict[int, float]:
    """The recorded tokens of a step and their log-probabilities (the sampled one always among them)."""
    found = dict(step.top)
    found[step.token_id] = step.logprob
    return found


def _stop_mass(
    decoded: Decoded, j: int, texts: list[bytes], base: bytes, stopped: bytes, going_on: bytes
) -> float:
    """The probability, at step j (answer text `base` before it), of a token that ends the answer:
    EOS where the answer may end, or text that starts the stopped answer and not the going-on one."""
    mass = 0.0
    for token, logprob in _candidates(decoded.logprobs[j]).items():
        if token == decoded.token_ids[j] or not math.isfinite(logprob):
            continue
        if token in decoded.eos_token_ids or token == decoded.tokenizer.eos_token_id:
            stops = base == stopped
        else:
            written = base + (texts[token] if token < len(texts) else b"")
            stops = (
                len(written) > len(base) and stopped.startswith(written) and not going_on.startswith(written)
            )
        mass += math.exp(logprob) if stops else 0.0
    return min(1.0, mass)


def _near_mass(decoded: Decoded, coordinate: _Coordinate, tolerance: float) -> float:
    mass = 1.0
    for j, value_of in coordinate.steps:
        near = 0.0
        for token, logprob in _candidates(decoded.logprobs[j]).items():
            value = value_of(token)
            if (
                value is not None
                and math.isfinite(logprob)
                and abs(value - coordinate.value) <= tolerance + 1e-9
            ):
                near += math.exp(logprob)
        mass *= min(1.0, near)
    return mass


def _tolerance(spec: spatial.SpatialSpec, item: list[_Coordinate], coordinate: _Coordinate) -> float:
    if spec.kind == "points":
        return POINT_TOLERANCE
    along = [c.value for c in item if c.axis == coordinate.axis]
    return BOX_TOLERANCE * (max(along) - min(along))


# Axes of an item's coordinates, in the order each encoding writes them.
_AXES = {("loc", "boxes"): (1, 0, 1, 0), ("loc", "points"): (1, 0), "boxes": (0, 1, 0, 1), "points": (0, 1)}


def _loc_coordinates(spec, decoded: Decoded, pieces, starts, text) -> list[_Coordinate]:
    """Location tokens: one step per coordinate, an alternative's value its bin's."""
    handle, fmt = decoded.tokenizer, spec.locations
    bins = {handle.token_to_id(token): k for k, token in enumerate(fmt.tokens())}
    value_of = lambda token: fmt.decode(bins[token]) if token in bins else None  # noqa: E731
    axes = _AXES["loc", spec.kind]
    found: list[_Coordinate] = []
    for j, token in enumerate(decoded.token_ids):
        if token in bins:
            found.append(
                _Coordinate(
                    fmt.decode(bins[token]), axes[len(found) % len(axes)], [(j, value_of)], starts[j + 1]
                )
            )
    return found


_NUMBER = re.compile(rb"\d+(?:\.\d+)?")


def _text_coordinates(spec, decoded: Decoded, pieces, starts, text) -> list[_Coordinate]:
    """Coordinates written as digits: the tokens over each number and the token that ends it; an
    alternative's value is the number read with that token in place of the sampled one."""
    spans = spec.coordinate_spans(text)
    axes = _AXES[spec.kind]
    scales = (getattr(spec, "width", None) or 1, getattr(spec, "height", None) or 1)
    texts = decoded.tokenizer.token_bytes()
    found: list[_Coordinate] = []
    for a, b in spans:
        axis = axes[len(found) % len(axes)]
        steps = [j for j in range(len(pieces)) if starts[j] <= b and starts[j + 1] > a]
        reread = _rereader(text, starts, texts, a, scales[axis])
        found.append(_Coordinate(float(text[a:b]) / scales[axis], axis, [(j, reread(j)) for j in steps], b))
    return found


def _rereader(text: bytes, starts: list[int], texts: list[bytes], at: int, scale: float):
    def at_step(j: int) -> Callable[[int], float | None]:
        def value_of(token: int) -> float | None:
            piece = texts[token] if token < len(texts) else b""
            if not piece:
                return None
            match = _NUMBER.match(text[: starts[j]] + piece + text[starts[j + 1] :], at)
            return float(match[0]) / scale if match else None

        return value_of

    return at_step
