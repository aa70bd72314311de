"""foveal.batch.run and `foveal batch` with the embedded model: the results a naive loop gets, in input
order, one line per image, a bad image as an error line, and bad jobs refused before any work."""

from __future__ import annotations

import json

import pytest

from foveal import batch
from foveal.cli import main


def _naive(model, paths, skill, *args):
    lines = []
    for path in paths:
        try:
            lines.append({"image": str(path), "result": dict(getattr(model, skill)(str(path), *args))})
        except ValueError as error:
            lines.append({"image": str(path), "error": {"type": type(error).__name__, "message": str(error)}})
    return lines


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_what_a_naive_loop_returns_in_input_order(model, scene_folder, tmp_path):
    out = tmp_path / "r.jsonl"
    job = batch.run(scene_folder, "detect", object="circle", model=model, out=out, progress=False)
    records = list(job)
    paths = sorted(p for p in scene_folder.rglob("*.png"))
    assert [r.image for r in records] == [str(p) for p in paths]
    assert (
        _lines(out) == [json.loads(r.to_json()) for r in records] == _naive(model, paths, "detect", "circle")
    )
    broken = next(r for r in records if r.image.endswith("broken.png"))
    assert broken.error["type"] == "ImageError" and "not a readable image" in broken.error["message"]
    summary = job.summary()
    assert (summary.done, summary.errors, summary.images) == (len(paths), 1, len(paths))
    assert summary.mean_batch > 1  # requests overlapped in the engine (a naive loop decodes 1 row per step)


def test_unordered_records_come_as_they_complete(model, scene_folder):
    records = list(
        batch.run(scene_folder, "point", object="shape", model=model, ordered=False, progress=False)
    )
    ordered = list(batch.run(scene_folder, "point", object="shape", model=model, progress=False))
    assert sorted(records, key=lambda r: r.image) == sorted(ordered, key=lambda r: r.image)


def test_generate_with_a_schema_and_images_given_in_python(model, scene_folder):
    paths = sorted(str(p) for p in scene_folder.glob("scene*.png"))[:3]
    schema = {"enum": ["red", "green", "blue"]}  # finite: the shapes model was never taught JSON
    job = batch.run(
        paths, "generate", prompt="colour", output_type=schema, settings={"max_tokens": 8}, model=model
    )
    records = list(job)
    assert [r.image for r in records] == paths
    assert all(r.result["output"] in schema["enum"] for r in records)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--skill", "detect"], "detect needs --object"),
        (["--skill", "caption", "--object", "x"], "--object does not apply to caption"),
        (["--skill", "detect", "--object", "x", "--settings", "{"], "--settings is not JSON"),
        (["--skill", "detect", "--object", "x", "--settings", '{"nope": 1}'], "nope"),
        (["--skill", "detect", "--object", ""], "object"),
    ],
)
def test_bad_jobs_exit_2_before_any_work(scene_folder, tmp_path, capsys, args, message):
    out = tmp_path / "r.jsonl"
    assert main(["batch", str(scene_folder), *args, "--out", str(out), "--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_an_unenforceable_schema_and_bad_inputs_exit_2(scene_folder, tmp_path, capsys):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    out = tmp_path / "r.jsonl"
    code = main(["batch", str(scene_folder), "--skill", "generate", "--prompt", "p", "--schema", str(schema),
                 "--out", str(out), "--device", "cpu"])  # fmt: skip
    assert code == 2 and "uniqueItems" in capsys.readouterr().err and not out.exists()
    (tmp_path / "empty").mkdir()
    assert main(["batch", str(tmp_path / "empty"), "--skill", "caption", "--out", str(out)]) == 2
    assert "holds no image files" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse: an unknown skill
        main(["batch", str(scene_folder), "--skill", "segment", "--out", str(out)])
    assert exited.value.code == 2


def test_cli_writes_the_apis_lines_and_refuses_to_overwrite(model, scene_folder, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    argv = [
        "batch",
        str(scene_folder),
        "--skill",
        "caption",
        "--length",
        "short",
        "--out",
        str(out),
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    assert "images/s" in capsys.readouterr().err
    expected = [
        r.to_json() for r in batch.run(scene_folder, "caption", length="short", model=model, progress=False)
    ]
    assert out.read_text().splitlines() == expected
    assert main(argv) == 2 and "--resume" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0  # nothing left to do: the file is unchanged
    assert out.read_text().splitlines() == expected
