"""The `foveal` command line, run in-process on the tiny shapes model (`--model`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image

from foveal import cli


@pytest.fixture(scope="module")
def picture(tmp_path_factory, image):
    path = tmp_path_factory.mktemp("cli") / "scene.png"
    image.save(path)
    return path


def run(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_detect_json_and_annotated_png(capsys, shapes_folder, shapes_model, picture, tmp_path):
    out_png = tmp_path / "boxes.png"
    status, out, _ = run(
        capsys,
        "detect",
        picture,
        "red circle",
        "--model",
        shapes_folder,
        "--json",
        "--out",
        out_png,
        "--max-objects",
        3,
    )
    assert status == 0
    result = json.loads(out)
    assert result == dict(shapes_model.detect(picture, "red circle", {"max_objects": 3}))
    assert Image.open(out_png).size == Image.open(picture).size


def test_point_prints_for_people(capsys, shapes_folder, shapes_model, picture):
    status, out, _ = run(capsys, "point", picture, "square", "--model", shapes_folder, "--max-objects", 2)
    assert status == 0
    points = shapes_model.point(picture, "square", {"max_objects": 2})["points"]
    assert out.splitlines()[0] == f"{len(points)} {'point' if len(points) == 1 else 'points'} for 'square'"
    assert len(out.splitlines()) == 1 + len(points)


def test_caption_streams_and_query_json(capsys, shapes_folder, shapes_model, picture):
    status, out, _ = run(
        capsys, "caption", picture, "--model", shapes_folder, "--length", "short", "--max-tokens", 12
    )
    assert status == 0
    assert out == shapes_model.caption(picture, "short", settings={"max_tokens": 12})["caption"] + "\n"
    status, out, _ = run(
        capsys, "query", picture, "how many?", "--model", shapes_folder, "--json", "--max-tokens", 12
    )
    assert status == 0
    assert json.loads(out) == dict(shapes_model.query(picture, "how many?", settings={"max_tokens": 12}))


def test_demo_renders_a_scene_and_reports_json(capsys, shapes_folder, tmp_path):
    out_png = tmp_path / "demo.png"
    status, out, _ = run(
        capsys, "demo", "--model", shapes_folder, "--seed", 3, "--out", out_png, "--max-tokens", 40
    )
    assert status == 0
    report = json.loads(out)
    assert {"scene", "detect", "point", "caption", "truth", "annotated"} <= set(report)
    assert Image.open(out_png).size == (160, 160)
    assert all(0 <= b["x_min"] < b["x_max"] <= 1 for b in report["detect"]["objects"])


def test_demo_on_an_image_file_reports_json_without_truth(capsys, shapes_folder, picture, tmp_path):
    out_png = tmp_path / "demo.png"
    status, out, _ = run(
        capsys,
        "demo",
        picture,
        "--object",
        "circle",
        "--model",
        shapes_folder,
        "--out",
        out_png,
        "--max-tokens",
        40,
    )
    assert status == 0
    report = json.loads(out)
    assert report["image"] == str(picture) and report["object"] == "circle" and "truth" not in report
    assert Image.open(out_png).size == Image.open(picture).size


@pytest.mark.parametrize(
    "argv, message",
    [
        (["detect", "{picture}", ""], "object is empty"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, shapes_folder, picture, tmp_path, argv, message):
    argv = [a.format(missing=tmp_path / "nope.png", picture=picture) for a in argv]
    status, out, err = run(capsys, *argv, "--model", shapes_folder)
    assert status == 2 and out == ""
    assert err.startswith("foveal: error:") and message in err


def test_without_the_embedded_model_the_error_says_how_to_train_it(capsys, picture, monkeypatch, tmp_path):
    import foveal.model as model_module

    monkeypatch.setattr(model_module, "EMBEDDED", tmp_path)
    status, _, err = run(capsys, "caption", picture)
    assert status == 2 and "train_shapes" in err


def test_console_script_help_and_version():
    done = subprocess.run(
        [sys.executable, "-m", "foveal", "detect", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "--out" in done.stdout and "--json" in done.stdout
    done = subprocess.run([sys.executable, "-m", "foveal", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("foveal ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["detect", "{picture}", "car", "--out", "/nonexistent/x.png"], "does not exist"),
        (["point", "{picture}", "car", "--out", "{folder}"], "is a folder"),
        (["detect", "{picture}", "car", "--out", "{folder}/boxes.txt2"], "image extension"),
        (["caption", "{picture}", "--device", "tpu"], "--device 'tpu'"),
        (["demo", "--size", "100000"], "--size 100000"),
        (["demo", "--size", "8"], "--size 8"),
        (["detect", "{folder}/missing.png", "circle"], "IMAGE {folder}/missing.png: no such file"),
        (["caption", "{folder}"], "is a folder"),
        (["query", "{folder}/notes.png", "why?"], "not an image PIL can read"),
        (["demo", "{folder}/missing.png"], "no such file"),
        (["point", "{picture}", "car", "--max-objects", "0"], "--max-objects 0"),
        (["caption", "{picture}", "--max-tokens", "0"], "--max-tokens 0"),
        (["caption", "{picture}", "--model", "{folder}/no/such/model"], "no such folder or file"),
    ],
)
def test_arguments_are_refused_in_one_line_before_the_model_loads(
    capsys, monkeypatch, picture, tmp_path, argv, message
):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(cli.foveal, "load", no_load)
    (tmp_path / "notes.png").write_text("not an image")
    status, out, err = run(capsys, *[a.format(picture=picture, folder=tmp_path) for a in argv])
    assert status == 2 and out == ""
    assert err.startswith("foveal: error:") and message.format(folder=tmp_path) in err and err.count("\n") == 1


def test_a_model_load_error_is_one_line(capsys, picture, tmp_path):
    (tmp_path / "no-model-here").mkdir()
    status, out, err = run(capsys, "caption", picture, "--model", tmp_path / "no-model-here")
    assert status == 2 and out == "" and err.startswith("foveal: error:") and err.count("\n") == 1
