"""The results file (batch/writer.py invariants): append-only, torn tail cut on resume, never overwritten."""

from __future__ import annotations

import json

import pytest

from foveal.batch import OutputError, ResultsWriter


def _line(key: str) -> str:
    return json.dumps({"image": key, "result": {"caption": key}})


def test_lines_are_appended_and_resume_reads_their_keys(tmp_path):
    out = tmp_path / "r.jsonl"
    with ResultsWriter(out, resume=False) as writer:
        writer.write("a", _line("a"))
        writer.write("b", _line("b"))
    assert out.read_text() == _line("a") + "\n" + _line("b") + "\n"
    with ResultsWriter(out, resume=True) as writer:
        assert writer.done == {"a", "b"}
        writer.write("c", _line("c"))
    assert [json.loads(x)["image"] for x in out.read_text().splitlines()] == ["a", "b", "c"]


def test_a_torn_last_line_and_only_it_is_cut_on_resume(tmp_path):
    out = tmp_path / "r.jsonl"
    whole = _line("a") + "\n" + _line("b") + "\n"
    out.write_text(whole + _line("c")[:17])  # killed while writing c
    with ResultsWriter(out, resume=True) as writer:
        assert writer.done == {"a", "b"}
        assert out.read_text() == whole
        writer.write("c", _line("c"))
    assert out.read_text() == whole + _line("c") + "\n"


def test_existing_results_are_never_overwritten_without_resume(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text(_line("a") + "\n")
    with pytest.raises(OutputError, match="--resume"):
        ResultsWriter(out, resume=False)
    assert out.read_text() == _line("a") + "\n"


def test_a_file_not_written_by_batch_is_refused(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text("hello\n")
    with pytest.raises(OutputError, match="not a results line"):
        ResultsWriter(out, resume=True)
    with pytest.raises(OutputError, match="is a folder"):
        ResultsWriter(tmp_path, resume=False)
    with pytest.raises(OutputError, match="does not exist"):
        ResultsWriter(tmp_path / "no" / "r.jsonl", resume=False)
