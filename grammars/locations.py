"""The location-token format: the one owner of `<locNNNN>` coordinates, answer items and their separator.

PROBLEM
    PaliGemma-style models answer detect and point in location tokens. The grammar that constrains
    the answer, the skills that parse it, and the training and evaluation scripts that write and
    read it must agree on every detail (bins, rounding, item layout, separator), or a model trained
    on one layout is decoded with another.
SOLUTION
    One frozen `LocationFormat(bins, separator)` states the format; everyone asks it:
    - N bins, tokens `<loc0000>`..`<loc{N-1:04d}>`; a coordinate v in [0, 1] encodes as bin
      k = round(v * (N - 1)) (clamped to [0, N - 1]) and decodes as k / (N - 1).
    - A box item is `<locYMIN><locXMIN><locYMAX><locXMAX> LABEL`, a point item `<locY><locX> LABEL`
      (LABEL: the object phrase, verbatim; no label: the tokens alone). Boxes have strictly positive
      extent in bins.
    - Items are joined by `separator` (" ; " unless the model's foveal.json says otherwise); zero
      items is the empty answer.
INVARIANTS (tests/grammars/test_spatial.py)
    1. `parse` reads exactly what the grammar (`grammars.spatial`, built from this format) allows and
       raises `LocationParseError` (a ValueError) on anything else: it never guesses.
    2. Parsing is unambiguous: a label cannot hold location-token text nor the separator
       (`check_label` refuses them), and the separator cannot hold location-token text.
    3. `encode(decode(k)) == k` for every bin.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_SEPARATOR = " ; "
MAX_BINS = 10000  # four digits in the token text
LOC_TOKEN = re.compile(r"<loc(\d{4})>")
COORDINATES = {"boxes": 4, "points": 2}  # location tokens per item


class LocationParseError(ValueError):
    """A text that is not an answer of the location format (e.g. cut short, or not constrained)."""


@dataclass(frozen=True, slots=True)
class LocationFormat:
    """Bins and item separator of the location-token format (see the module docstring)."""

    bins: int = 1024
    separator: str = DEFAULT_SEPARATOR

    def __post_init__(self) -> None:
        if isinstance(self.bins, bool) or not isinstance(self.bins, int) or not 2 <= self.bins <= MAX_BINS:
            raise ValueError(f"bins={self.bins!r}; location tokens need an int with 2 <= bins <= {MAX_BINS}")
        if not isinstance(self.separator, str) or not self.separator.strip():
            raise ValueError(
                f"separator={self.separator!r}; it must be text with a visible character, e.g. {DEFAULT_SEPARATOR!r}"
            )
        if "<loc" in self.separator or any(c in self.separator for c in "\n\r"):
            raise ValueError(
                f"separator={self.separator!r} cannot hold location-token text or a line break; "
                f"use e.g. {DEFAULT_SEPARATOR!r}"
            )

    # ---- tokens and coordinates ----

    @staticmethod
    def token(k: int) -> str:
        return f"<loc{k:04d}>"

    def tokens(self) -> list[str]:
        """Every location token, bin 0 first."""
        return [self.token(k) for k in range(self.bins)]

    def encode(self, value: float) -> int:
        """The bin of a normalized coordinate (values outside [0, 1] clamp to the edge bins)."""
        return min(max(round(value * (self.bins - 1)), 0), self.bins - 1)

    def decode(self, k: int) -> float:
        return k / (self.bins - 1)

    def box_bins(self, box: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
        """(ymin, xmin, ymax, xmax) bins of an (x_min, y_min, x_max, y_max) box, with positive extent."""
        x0, y0, x1, y1 = box
        ky0, ky1 = _widen(self.encode(y0), self.encode(y1), self.bins)
        kx0, kx1 = _widen(self.encode(x0), self.encode(x1), self.bins)
        return ky0, kx0, ky1, kx1

    # ---- writing answers (training targets) ----

    def box_item(self, box: tuple[float, float, float, float], label: str = "") -> str:
        return "".join(self.token(k) for k in self.box_bins(box)) + _tail(label)

    def point_item(self, x: float, y: float, label: str = "") -> str:
        return self.token(self.encode(y)) + self.token(self.encode(x)) + _tail(label)

    def join(self, items: list[str]) -> str:
        return self.separator.join(items)

    @staticmethod
    def label_text(label: str) -> str:
        """The text after an item's location tokens: `" LABEL"`, nothing without a label."""
        return _tail(label)

    # ---- labels ----

    def check_label(self, label: str) -> str:
        """`label` if an answer with it parses unambiguously; ValueError saying what to change otherwise."""
        if "<loc" in label:
            raise ValueError(
                f"object phrase {label!r} holds location-token text (<locNNNN>), which the answer uses "
                "for coordinates; describe the object in words"
            )
        if label and self.separator.strip() in label:
            raise ValueError(
                f"object phrase {label!r} holds {self.separator.strip()!r}, the separator between answer "
                "items; ask for one kind of object per call (e.g. 'circle', then 'square')"
            )
        return label

    # ---- reading answers ----

    def parse(self, kind: str, text: str, label: str = "") -> list[dict[str, float]]:
        """The boxes or points of a constrained answer; LocationParseError if the grammar could not make `text`."""
        count = COORDINATES[kind]
        tail = _tail(label)
        items: list[dict[str, float]] = []
        position = 0
        while position < len(text):
            if items:
                position = self._expect(text, position, self.separator, "the separator")
            bins = []
            for _ in range(count):
                match = LOC_TOKEN.match(text, position)
                if match is None or int(match[1]) >= self.bins:
                    raise LocationParseError(
                        f"expected a location token <loc0000>..{self.token(self.bins - 1)} at character "
                        f"{position} of {text!r}"
                    )
                bins.append(int(match[1]))
                position = match.end()
            position = self._expect(text, position, tail, "the label")
            items.append(self._item(kind, bins))
        return items

    def parse_lenient(self, kind: str, text: str) -> list[dict[str, float]]:
        """Boxes or points from unconstrained text (evaluation): items without exactly the right number
        of location tokens are skipped, whatever their label."""
        count = COORDINATES[kind]
        items = []
        for chunk in text.split(self.separator.strip()):
            bins = [int(k) for k in LOC_TOKEN.findall(chunk)]
            if len(bins) == count and max(bins) < self.bins:
                items.append(self._item(kind, bins))
        return items

    def _item(self, kind: str, bins: list[int]) -> dict[str, float]:
        values = [self.decode(k) for k in bins]
        if kind == "points":
            y, x = values
            return {"x": x, "y": y}
        y_min, x_min, y_max, x_max = values
        return {"x_min": x_min, "y_min": y_min, "x_max": x_max, "y_max": y_max}

    @staticmethod
    def _expect(text: str, position: int, literal: str, what: str) -> int:
        if not text.startswith(literal, position):
            raise LocationParseError(f"expected {what} {literal!r} at character {position} of {text!r}")
        return position + len(literal)


def _tail(label: str) -> str:
    return f" {label}" if label else ""


def _widen(lo: int, hi: int, n: int) -> tuple[int, int]:
    """Give a span at least one bin of extent, staying inside [0, n - 1]."""
    if hi > lo:
        return lo, hi
    return (lo, lo + 1) if lo + 1 <= n - 1 else (lo - 1, lo)
