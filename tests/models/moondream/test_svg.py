"""Moondream 3's segment answer as Moondream's API returns it (families/moondream/svg.py): the path
spelled one token at a time on the 960 viewbox, normalized; stream chunks that join to it; the box
of the first centre and size, clamped."""

from __future__ import annotations

import pytest

from foveal.families.moondream.svg import (
    VIEWBOX,
    PathWriter,
    bbox_from_region,
    normalized,
    path_from_pieces,
    path_piece,
)
from foveal.vision.svg import SvgPathError, check_inside

# A square's outline as the model spells it: one command or integer per token, "-" before an
# integer it negates (relative moves), padding a tokenizer may leave around a token's text.
PIECES = ["M", " 96", "192", "l", "480", "0", " ", "0", "240", "h", "-", "480", "Z"]


def test_the_pieces_spell_a_normalized_path():
    assert path_from_pieces(PIECES) == "M 0.1 0.2 l 0.5 0 0 0.25 h -0.5 Z"
    assert check_inside(path_from_pieces(PIECES))


def test_stream_chunks_join_to_the_path():
    writer = PathWriter()
    chunks = [writer.add(piece) for piece in PIECES]
    assert "".join(chunks) == writer.path == writer.finish()
    assert chunks[:3] == ["M", " 0.1", " 0.2"] and chunks[6] == "" and chunks[10] == ""  # blank, then a "-"
    assert "  " not in writer.path


def test_a_token_holding_a_command_and_an_integer():
    assert path_from_pieces(["M480", "480", "L960", "0"]) == "M 0.5 0.5 L 1 0"


@pytest.mark.parametrize(
    ("pieces", "says"),
    [
        (["M", "tok12"], "no part of an SVG path"),
        (["M", "1.5", "2"], "no part of an SVG path"),
        (["M", "-", "-", "1"], "two '-' in a row"),
        (["M", "-", "L"], "before the command"),
        (["M", "1", "2", "-"], "ends with a '-'"),
        (["M", "1"], "M takes 2 numbers"),
        (["M", "480", "1200"], "lies outside"),
    ],
)
def test_what_is_not_a_path_is_refused(pieces, says):
    with pytest.raises(SvgPathError, match=says):
        path_from_pieces(pieces)


def test_outside_points_can_be_let_through_for_a_check_elsewhere():
    assert path_from_pieces(["M", "480", "1200"], inside=False) == "M 0.5 1.25"


def test_which_token_texts_are_path_pieces():
    assert all(path_piece(t) for t in ("M", "z", "-", "960", " 12 ", "M12", "C"))
    assert not any(path_piece(t) for t in ("", " ", "tok5", "1.5", "X", "12,", "<|endoftext|>"))


def test_a_viewbox_path_is_normalized():
    assert normalized(f"M 0 0 L {VIEWBOX} {VIEWBOX // 2} Z") == "M 0 0 L 1 0.5 Z"
    assert normalized("M 1 1") == "M 0.001 0.001"


def test_the_box_is_the_first_centre_and_size_clamped():
    assert bbox_from_region(0.5, 0.5, 0.2, 0.4) == pytest.approx({"x_min": 0.4, "y_min": 0.3, "x_max": 0.6, "y_max": 0.7})
    edge = bbox_from_region(0.05, 0.98, 0.2, 0.1)
    assert edge == pytest.approx({"x_min": 0.0, "y_min": 0.93, "x_max": 0.15, "y_max": 1.0})
    assert bbox_from_region(1.3, -0.2, 2.0, 0.5) == pytest.approx({"x_min": 0.5, "y_min": 0.0, "x_max": 1.0, "y_max": 0.25})
