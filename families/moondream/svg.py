"""Moondream 3's segment answer, read as Moondream's API returns it: an SVG path in normalized
coordinates and the object's box. The generic pieces the family's segment skill builds on.

PROBLEM
    Moondream 3 answers `segment(image, object)` in two parts (the README of the moondream3-tiny
    fixture, from Moondream's own engine): region steps first (a centre's x and y from the coord
    head, a size (w, h) from the size head: the object's box), then text tokens that spell an SVG
    path on a 960 x 960 viewbox, one command letter or one integer per token, a "-" token negating
    the integer after it. Moondream's API returns that path scaled to [0, 1] (numbers with at most
    3 decimals, trailing zeros stripped, joined by single spaces) and the box clamped to the image;
    a stream sends the box as soon as it is known, then the path in pieces that join to it.
SOLUTION
    `PathWriter` takes the answer's text tokens one by one (each decoded alone and stripped) and
    keeps the path they spell: `add(piece)` returns the text it settles, which is what a stream
    sends (a command at once, an integer at the end of its token, which is its end: integers never
    span tokens), so the chunks of a stream join to the final path exactly. `finish()` checks the
    whole path (foveal.vision.svg: it parses; `check_inside` for the points). `path_piece` says
    which token texts can be part of a path (a family's answer automaton allows only those).
    `bbox_from_region(x, y, w, h)` is the box of the first centre and size, clamped to [0, 1];
    `normalized(d)` rescales a path written on the viewbox.
INVARIANTS (tests/models/moondream/test_svg.py)
    - The chunks `add` returns, joined, equal `path`; `path` uses only single spaces.
    - A piece that is not part of a path is refused (SvgPathError naming it), never skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from foveal.vision.svg import (
    ARITY,
    SvgPathError,
    check_inside,
    format_number,
    parse_path,
    scale_path,
    write_path,
)

VIEWBOX = 960  # the path's integers are on a VIEWBOX x VIEWBOX grid over the image
DECIMALS = 3  # how Moondream's API writes the normalized numbers
_PIECE = re.compile(r"[A-Za-z]|-|\d+")


def path_piece(text: str) -> bool:
    """Whether a token's text (stripped) can be part of a path: a command letter, "-", an integer,
    or a run of them ("M12" is a command and an integer); blank text is no part (nothing to write)."""
    text = text.strip()
    return bool(text) and "".join(_PIECE.findall(text)) == text and all(
        p.upper() in ARITY for p in _PIECE.findall(text) if p.isalpha()
    )


def path_items(text: str) -> list[str]:
    """A path piece's items in order: command letters, "-" and integers ("M12" is ["M", "12"])."""
    return _PIECE.findall(text.strip())


class PathWriter:
    """The normalized path spelled by a segment answer's text tokens, one token at a time."""

    __slots__ = ("_parts", "_negate", "viewbox")

    def __init__(self, viewbox: int = VIEWBOX) -> None:
        self.viewbox = viewbox
        self._parts: list[str] = []  # settled: commands and normalized numbers, as written
        self._negate = False  # a "-" waits for its integer

    def add(self, piece: str) -> str:
        """Read one token's text; returns the path text it settles ("" when none), with the space
        before it when the path already had text."""
        text = piece.strip()
        if not text:
            return ""
        if not path_piece(text):
            raise SvgPathError(f"segment: the token {piece!r} is no part of an SVG path (commands, '-', integers)")
        settled: list[str] = []
        for item in _PIECE.findall(text):
            if item == "-":
                if self._negate:
                    raise SvgPathError("segment: two '-' in a row; a '-' negates the one integer after it")
                self._negate = True
            elif item.isdigit():
                value = -int(item) if self._negate else int(item)
                self._negate = False
                settled.append(format_number(value / self.viewbox, DECIMALS))
            else:
                if self._negate:
                    raise SvgPathError(f"segment: '-' before the command {item!r}; it negates integers only")
                settled.append(item)
        if not settled:
            return ""
        chunk = " ".join(settled)
        chunk = f" {chunk}" if self._parts else chunk
        self._parts.extend(settled)
        return chunk

    @property
    def path(self) -> str:
        """The path so far (what the chunks returned so far join to)."""
        return " ".join(self._parts)

    def finish(self, inside: bool = True) -> str:
        """The whole path, checked: no "-" left waiting, it parses as SVG path data, and (`inside`)
        every point lies in the image; SvgPathError saying what is wrong otherwise."""
        if self._negate:
            raise SvgPathError("segment: the path ends with a '-' and no integer after it")
        path = self.path
        if inside:
            check_inside(path)
        else:
            parse_path(path)
        return path


def path_from_pieces(pieces: Iterable[str], viewbox: int = VIEWBOX, inside: bool = True) -> str:
    """The checked normalized path of a whole answer's text tokens (`PathWriter` over all of them)."""
    writer = PathWriter(viewbox)
    for piece in pieces:
        writer.add(piece)
    return writer.finish(inside)


def normalized(d: str, viewbox: int = VIEWBOX) -> str:
    """An SVG path written on the viewbox, rescaled to [0, 1] as Moondream's API writes it."""
    return write_path(scale_path(parse_path(d), 1 / viewbox), DECIMALS)


def bbox_from_region(x: float, y: float, w: float, h: float) -> dict[str, float]:
    """The box of a centre (x, y) and a size (w, h), all normalized, each clamped to [0, 1] first
    and the box's edges after: Moondream's API box of a segment (its first centre and size)."""
    x, y, w, h = (min(max(float(v), 0.0), 1.0) for v in (x, y, w, h))
    return {
        "x_min": max(x - w / 2, 0.0),
        "y_min": max(y - h / 2, 0.0),
        "x_max": min(x + w / 2, 1.0),
        "y_max": min(y + h / 2, 1.0),
    }
