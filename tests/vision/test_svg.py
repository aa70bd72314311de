"""SVG path data (foveal.vision.svg): parsing with SVG's implicit repetitions, absolute points,
checks that say where a path fails, scaling and writing back."""

from __future__ import annotations

import pytest

from foveal.vision.svg import (
    Segment,
    SvgPathError,
    bounds,
    check_inside,
    format_number,
    parse_path,
    path_points,
    scale_path,
    write_path,
)


def test_implicit_repetitions_become_explicit_segments():
    assert parse_path("M 0.1 0.2 0.3 0.4 0.5,0.6 z") == [
        Segment("M", (0.1, 0.2)), Segment("L", (0.3, 0.4)), Segment("L", (0.5, 0.6)), Segment("z", ()),
    ]
    assert parse_path("m1 1 2 2") == [Segment("m", (1.0, 1.0)), Segment("l", (2.0, 2.0))]
    assert parse_path("M0-1L.5.5") == [Segment("M", (0.0, -1.0)), Segment("L", (0.5, 0.5))]
    assert parse_path("  ") == []


@pytest.mark.parametrize(
    ("d", "says"),
    [
        ("L 1 1", "must start with M"),
        ("0.5 0.5", "must start with a command"),
        ("M 0.5", "M takes 2 numbers"),
        ("M 0 0 C 1 1 2", "C takes 6 numbers"),
        ("M 0 0 X 1", "'X' is not a path command"),
        ("M 0 0 Z 1", "follows Z"),
        ("M 0 0 # 1", "cannot read"),
    ],
)
def test_bad_path_data_says_where(d, says):
    with pytest.raises(SvgPathError, match=says):
        parse_path(d)


def test_points_are_absolute():
    points = path_points(parse_path("M 0.5 0.5 l 0.1 0 v 0.2 h -0.3 Z l 0.1 0.1 C 0 0 1 1 0.2 0.2 A 1 1 0 0 1 0.9 0.1"))
    want = [(0.5, 0.5), (0.6, 0.5), (0.6, 0.7), (0.3, 0.7), (0.6, 0.6), (0, 0), (1, 1), (0.2, 0.2), (0.9, 0.1)]
    assert [c for p in points for c in p] == pytest.approx([c for p in want for c in p])
    assert bounds(points) == pytest.approx((0.0, 0.0, 1.0, 1.0))


def test_check_inside_refuses_a_point_outside_and_an_empty_path():
    assert len(check_inside("M 0 0 L 1 1 Z")) == 3
    with pytest.raises(SvgPathError, match=r"\(1.2, 0.5\) lies outside"):
        check_inside("M 0.5 0.5 L 1.2 0.5")
    with pytest.raises(SvgPathError, match="empty"):
        check_inside("")
    assert check_inside("M 5 5", box=(0, 0, 10, 10))


def test_scaling_keeps_arc_flags_and_rotation():
    scaled = scale_path(parse_path("M 480 960 a 96 48 30 1 0 96 0 H 960 v -480"), 1 / 960)
    assert write_path(scaled) == "M 0.5 1 a 0.1 0.05 30 1 0 0.1 0 H 1 v -0.5"
    assert write_path(scale_path(parse_path("M 1 1"), 2, 3)) == "M 2 3"


def test_numbers_are_written_as_the_api_writes_them():
    assert [format_number(v) for v in (0.5, 1.0, 0.0, -0.0004, 0.12345, 2 / 3, -0.25)] == [
        "0.5", "1", "0", "0", "0.123", "0.667", "-0.25",
    ]


def test_writing_back_reads_the_same():
    d = "M 0.125 0.5 L 0.75 0.5 Q 0.5 0.9 0.125 0.5 Z"
    assert parse_path(write_path(parse_path(d))) == parse_path(d)
