"""SVG path data (the `d` of `<path d="...">`): parsing, checking, scaling and writing it, for
segmentation masks that a model answers as a path.

PROBLEM
    A segment answer is an outline written as SVG path data, in normalized image coordinates
    (origin top-left, x and y in [0, 1]). A result must be refused where it is made when its path
    does not parse (an unknown command, a command short of its numbers) or leaves the image, and
    a family that writes its path on another scale (a model's own viewbox) must rescale it exactly.
SOLUTION
    `parse_path` reads path data into `Segment`s (a command and its numbers, SVG's implicit
    repetitions made explicit: `M 0 0 1 1` is `M 0 0` then `L 1 1`), raising `SvgPathError` (a
    ValueError) that says where it failed. `path_points` resolves them to absolute points (end
    points and control points: what a check or a drawing needs; arcs by their end points).
    `check_inside` refuses a path with a point outside a box; `scale_path` multiplies every length
    (coordinates, relative steps, arc radii, never arc flags or angles); `write_path` writes
    segments back with numbers rounded to a fixed number of decimals, trailing zeros stripped.
INVARIANTS (tests/vision/test_svg.py)
    - `parse_path(write_path(parse_path(d)))` equals `parse_path(d)` up to the rounding.
    - Every point `path_points` gives is absolute: relative commands are resolved against the
      current point, and `Z` returns it to the subpath's start.
This module depends on no other foveal package.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Numbers each command takes (its lower-case twin is the relative form).
ARITY = {"M": 2, "L": 2, "H": 1, "V": 1, "C": 6, "S": 4, "Q": 4, "T": 2, "A": 7, "Z": 0}
# Which numbers of a command's group are lengths along x ("x") or along y ("y"), or neither ("-":
# an arc's rotation and flags). An arc's radii scale with their axes: rx with x, ry with y.
_ROLES = {
    "M": "xy", "L": "xy", "H": "x", "V": "y", "C": "xyxyxy", "S": "xyxy", "Q": "xyxy", "T": "xy",
    "A": "xy---xy", "Z": "",
}
_TOKEN = re.compile(r"\s*(?:([A-Za-z])|([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?))\s*,?")


class SvgPathError(ValueError):
    """Path data that does not parse, or a path that breaks a check; the message says where."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One path command and its numbers (one group: `L 1 2 3 4` is two segments)."""

    command: str  # as written: upper case absolute, lower case relative
    args: tuple[float, ...]


def parse_path(d: str) -> list[Segment]:
    """Path data -> its segments; SvgPathError for anything SVG would not draw."""
    if not isinstance(d, str):
        raise SvgPathError(f"an SVG path is a string, got {type(d).__name__}")
    items: list[str | float] = []
    position = 0
    while position < len(d):
        found = _TOKEN.match(d, position)
        if found is None or found.end() == position:
            if d[position:].strip(" \t\r\n,") == "":
                break
            raise SvgPathError(f"SVG path: cannot read {d[position:position + 20]!r} at character {position}")
        letter, number = found.groups()
        items.append(letter if letter is not None else float(number))
        position = found.end()
    return _segments(items, d)


def _segments(items: list[str | float], d: str) -> list[Segment]:
    segments: list[Segment] = []
    i = 0
    command: str | None = None
    while i < len(items):
        item = items[i]
        if isinstance(item, str):
            if item.upper() not in ARITY:
                raise SvgPathError(f"SVG path: {item!r} is not a path command (use one of {''.join(ARITY)})")
            command, i = item, i + 1
            if command.upper() == "Z":
                segments.append(Segment(command, ()))
                continue
        elif command is None:
            raise SvgPathError(f"SVG path must start with a command such as M, got the number {item!r}")
        elif command.upper() == "Z":
            raise SvgPathError(f"SVG path: the number {item!r} follows Z, which takes none")
        arity = ARITY[command.upper()]
        group = items[i : i + arity]
        if len(group) < arity or any(isinstance(x, str) for x in group):
            raise SvgPathError(f"SVG path: {command} takes {arity} numbers; {d[:60]!r} gives fewer")
        segments.append(Segment(command, tuple(float(x) for x in group)))
        i += arity
        if command in "Mm":  # numbers after a move's first pair are lines (SVG's rule)
            command = "L" if command == "M" else "l"
    if segments and segments[0].command not in "Mm":
        raise SvgPathError(f"SVG path must start with M (a move), not {segments[0].command}")
    return segments


def path_points(segments: Iterable[Segment]) -> list[tuple[float, float]]:
    """The absolute points of a path: every end point and control point (an arc: its end point)."""
    points: list[tuple[float, float]] = []
    x = y = start_x = start_y = 0.0
    for seg in segments:
        kind, relative, a = seg.command.upper(), seg.command.islower(), seg.args
        dx, dy = (x, y) if relative else (0.0, 0.0)
        if kind == "Z":
            x, y = start_x, start_y
            continue
        if kind == "H":
            x = a[0] + dx
        elif kind == "V":
            y = a[0] + dy
        elif kind == "A":
            x, y = a[5] + dx, a[6] + dy
        else:
            pairs = [(a[k] + dx, a[k + 1] + dy) for k in range(0, len(a), 2)]
            points.extend(pairs[:-1])  # control points
            x, y = pairs[-1]
        points.append((x, y))
        if kind == "M":
            start_x, start_y = x, y
    return points


def check_inside(d: str, box: tuple[float, float, float, float] = (0.0, 0.0, 1.0, 1.0)) -> list[Segment]:
    """`d`'s segments if it parses, is not empty and every point lies in `box` (x_min, y_min,
    x_max, y_max; the image by default, in normalized coordinates); SvgPathError otherwise."""
    segments = parse_path(d)
    if not segments:
        raise SvgPathError("the SVG path is empty; a mask's outline starts with M x y")
    x_min, y_min, x_max, y_max = box
    for x, y in path_points(segments):
        if not (math.isfinite(x) and math.isfinite(y) and x_min <= x <= x_max and y_min <= y <= y_max):
            raise SvgPathError(f"SVG path: the point ({x:g}, {y:g}) lies outside {box}")
    return segments


def scale_path(segments: Iterable[Segment], sx: float, sy: float | None = None) -> list[Segment]:
    """The path with every x length times `sx` and every y length times `sy` (default: `sx`); arc
    radii scale with their axis, arc rotations and flags stay as they are."""
    sy = sx if sy is None else sy
    factor = {"x": sx, "y": sy, "-": 1.0}
    out = []
    for seg in segments:
        roles = _ROLES[seg.command.upper()]
        out.append(Segment(seg.command, tuple(v * factor[r] for v, r in zip(seg.args, roles, strict=True))))
    return out


def format_number(value: float, decimals: int = 3) -> str:
    """`value` rounded to `decimals`, trailing zeros and a lone point stripped, never "-0"."""
    text = f"{round(value, decimals):.{decimals}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def write_path(segments: Iterable[Segment], decimals: int = 3) -> str:
    """Path data of `segments`: each command, then its numbers, all separated by single spaces."""
    parts: list[str] = []
    for seg in segments:
        parts.append(seg.command)
        parts.extend(format_number(v, decimals) for v in seg.args)
    return " ".join(parts)


def bounds(points: Sequence[tuple[float, float]]) -> tuple[float, float, float, float]:
    """(x_min, y_min, x_max, y_max) of some points (a path's, from `path_points`)."""
    if not points:
        raise SvgPathError("a path without points has no bounds")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return min(xs), min(ys), max(xs), max(ys)
