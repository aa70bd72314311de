"""A JSONL cell that is not base64 is an error line saying so (inputs.Unreadable), locally and on Ray;
a results file that holds an image twice is refused on resume, naming the file and both lines
(writer.read_lines)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from foveal import batch
from foveal.batch.writer import read_lines
from foveal.vision import scenes


def _png(seed: int) -> str:
    buffer = io.BytesIO()
    scenes.render(scenes.generate_scene(seed, 64)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
def rows(tmp_path) -> Path:
    path = tmp_path / "rows.jsonl"
    cells = [_png(0), "!!not base64!!", _png(1)]
    path.write_text(
        "".join(json.dumps({"id": f"r{i}", "image_base64": c}) + "\n" for i, c in enumerate(cells))
    )
    return path


def test_invalid_base64_in_a_row_is_its_error_line_saying_so(model, rows, tmp_path):
    out = tmp_path / "out.jsonl"
    records = list(batch.run(rows, "caption", model=model, out=out, progress=False))
    assert [r.image for r in records] == ["r0", "r1", "r2"]
    assert records[0].error is None and records[2].error is None  # the other rows go on
    error = records[1].error
    assert error["type"] == "ImageError"
    message = error["message"]
    assert (
        f"INPUT {rows} line 2 column 'image_base64' is not valid base64" in message
    )  # was "image bytes are empty"
    assert "empty" not in message and "RFC 4648" in message


def test_an_empty_base64_cell_is_still_empty_bytes(rows):
    rows.write_text(json.dumps({"image_base64": ""}) + "\n")
    assert list(batch.open_input(rows).sources()) == [b""]  # valid base64 of nothing: the loader says empty


def test_a_results_file_with_an_image_twice_is_refused_naming_file_and_lines(model, rows, tmp_path):
    out = tmp_path / "out.jsonl"
    batch.run(rows, "caption", model=model, out=out, progress=False).run()
    first, second, third = out.read_text().splitlines()
    out.write_text("\n".join([first, second, first, third]) + "\n")  # r0 again at line 3
    before = out.read_bytes()
    for allow_changed in (False, True):
        with pytest.raises(batch.OutputError) as info:
            batch.run(rows, "caption", model=model, out=out, resume=True, allow_changed=allow_changed).run()
        message = str(info.value)
        assert f"--out {out} line 3 repeats the result for image 'r0' of line 1" in message
        assert "INPUT changed" not in message  # it said the input changed, which it had not
    assert out.read_bytes() == before  # refused before any byte is written
    with pytest.raises(batch.OutputError, match="line 3 repeats"):
        read_lines(out)
