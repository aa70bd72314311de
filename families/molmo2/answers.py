"""Molmo 2's native pointing answers, decoded under a grammar that keeps every point inside the image.

Molmo 2 points in its own text format: `<points coords="1 1 073 160 2 173 600">phrase</points>`: the
image's index (1: the call's one image), then per point its index (1, 2, ...) and x, y in
thousandths of the image's width and height (three digits, zero-padded), and the phrase; an absent
object is `There are none.`. The grammar (`MolmoPointsSpec`, a `grammars.spatial.SpatialSpec`, so
token budgets and `max_objects` work as for every spatial answer) allows exactly that shape: point
indices in order 1 .. max_objects, every coordinate 000 .. 999 or 1000 (inside the image, edges
included), the caller's phrase as the label. `parse_answer` gives foveal's normalized points
(thousandths / 1000).

Scores (`point_scores`): a point's score is the product, over the tokens that wrote its two
coordinates, of the probability of the alternatives at that step that would have put the
coordinate within `POINT_TOLERANCE` of the image's side of the written value (the recorded
alternatives: a lower bound), the "near mass" of families/scores.py's scores, without its stop mass.

INVARIANTS (tests/models/test_molmo2.py)
    - Every answer the grammar allows parses, with every point in [0, 1] x [0, 1] and at most
      max_objects points; the empty answer is no points.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from foveal.families.scores import POINT_TOLERANCE, Decoded
from foveal.grammars.automaton import Automaton, lark_automaton
from foveal.grammars.errors import SchemaError
from foveal.grammars.spatial import AnswerLayout, Coordinate, SpatialSpec, check_spellable
from foveal.grammars.tokenizer import TokenizerHandle

NONE = "There are none."
OPEN, SCALE = '<points coords="1', 1000
COORDINATE = r"[0-9]{3}|1000"
_TRIPLET = re.compile(r" (\d+) (\d{3,4}) (\d{3,4})")


@dataclass(frozen=True, slots=True)
class MolmoPointsSpec(SpatialSpec):
    """Molmo 2's points of one image (module docstring); pass to `grammars.compile`."""

    encoding: str = "molmo"

    def __post_init__(self) -> None:
        if self.kind != "points":
            raise SchemaError("Molmo 2 answers with points only; its spec's kind is 'points'")
        if self.max_objects < 1:
            raise SchemaError(f"max_objects={self.max_objects}; it must be at least 1")
        if not self.label or any(c in self.label for c in '<>"'):
            raise SchemaError(f"label {self.label!r}: a Molmo 2 label is a non-empty phrase without < > or \"")

    def cache_key(self) -> str:
        return f"molmo2-points:{self.max_objects}:{self.label!r}"

    def example_answer(self, items: int) -> str:
        if not items:
            return NONE
        return OPEN + "".join(f" {k} 1000 1000" for k in range(1, items + 1)) + self._close()

    def _close(self) -> str:
        return f'">{self.label}</points>'

    def layout(self) -> AnswerLayout:
        """The answer's pieces for token budgets: the point index counted as a coordinate of its longest spelling."""
        index = Coordinate(len(str(self.max_objects)))
        item = (" ", index, " ", Coordinate(4), " ", Coordinate(4))
        return AnswerLayout(NONE, OPEN, item, "", self._close())

    def lark(self) -> str:
        # points k .. max_objects: each optional after the one before it, so indices run 1, 2, 3, ...
        rules = [f"start: {json.dumps(NONE)} | {json.dumps(OPEN)} p1 {json.dumps(self._close())}"]
        for k in range(1, self.max_objects + 1):
            more = f" p{k + 1}?" if k < self.max_objects else ""
            rules.append(f'p{k}: " {k} " C " " C{more}')
        rules.append(f"C: /{COORDINATE}/")
        return "\n".join(rules)

    def build(self, handle: TokenizerHandle, key: str) -> Automaton:
        check_spellable(self, handle)
        return lark_automaton(handle, key, "molmo2-points", self.lark())

    def parse_answer(self, text: str) -> dict:
        """foveal's normalized points of an answer (ValueError on text the grammar cannot produce)."""
        body = text.strip()
        if body == NONE:
            return {"points": []}
        if not (body.startswith(OPEN) and body.endswith(self._close())):
            raise ValueError(f"not a Molmo 2 points answer: {text[:80]!r}")
        triplets = _TRIPLET.findall(body[len(OPEN) : -len(self._close())])
        return {"points": [{"x": int(x) / SCALE, "y": int(y) / SCALE} for _, x, y in triplets]}


def point_scores(decoded: Decoded) -> list[float]:
    """A score per point of a Molmo 2 answer, in order (module docstring)."""
    pieces, starts, text = decoded.pieces()
    texts = decoded.tokenizer.token_bytes()
    scores = []
    for match in re.finditer(rb" \d+ (\d{3,4}) (\d{3,4})", text):
        score = 1.0
        for group in (1, 2):
            a, b = match.span(group)
            value = int(text[a:b]) / SCALE
            for j in (j for j in range(len(pieces)) if starts[j] < b and starts[j + 1] > a):
                score *= _near(decoded, j, texts, text, starts, a, value)
        scores.append(min(1.0, max(0.0, score)))
    return scores


def _near(decoded: Decoded, j: int, texts: list[bytes], text: bytes, starts: list[int], at: int, value: float):
    """The probability of the alternatives at step j that keep the coordinate at `at` near `value`."""
    step = decoded.logprobs[j]
    candidates = dict(step.top)
    candidates[step.token_id] = step.logprob
    mass = 0.0
    for token, logprob in candidates.items():
        piece = texts[token] if token < len(texts) else b""
        if not piece or not math.isfinite(logprob):
            continue
        found = re.compile(rb"\d{1,4}").match(text[: starts[j]] + piece + text[starts[j + 1] :], at)
        if found and abs(int(found[0]) / SCALE - value) <= POINT_TOLERANCE + 1e-9:
            mass += math.exp(logprob)
    return min(1.0, mass)
