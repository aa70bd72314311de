"""`--resume` checks that the results file belongs to the job being run (batch/job.py invariants): another
job, or a changed input without --allow-changed, exits 2 with one line and leaves both files byte-identical;
with --allow-changed the unchanged lines are kept and the file ends as an uninterrupted run's."""

from __future__ import annotations

import json
import os

import pytest

from foveal import batch
from foveal.batch import SkillCall, open_input
from foveal.batch.job import job_path, job_record, open_results, plan_output
from foveal.cli import main
from foveal.vision import scenes

DETECT = ["--skill", "detect", "--object", "circle"]


def _cli(folder, out, *args):
    return main(["batch", str(folder), *args, "--out", str(out), "--quiet", "--device", "cpu"])


def _modify(path, seed):
    """Rewrite an image with other pixels, its mtime a second later (what an edit an instant later looks
    like on a filesystem whose clock ticks coarser than the test)."""
    scenes.render(scenes.generate_scene(seed, 64)).save(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def _expected(model, folder):
    return [r.to_json() for r in batch.run(folder, "detect", object="circle", model=model, progress=False)]


@pytest.fixture
def done_job(model, scene_writer, tmp_path):
    """A finished detect job over 4 images, its file ending in a torn line (a kill mid-write)."""
    folder = tmp_path / "images"
    scene_writer(folder, 4)
    out = tmp_path / "r.jsonl"
    batch.run(folder, "detect", object="circle", model=model, out=out, progress=False).run()
    with out.open("ab") as torn:
        torn.write(b'{"image": "' + str(folder).encode())
    return folder, out


def _snapshot(out):
    return out.read_bytes(), job_path(out).read_bytes()


@pytest.mark.parametrize(
    ("args", "differs"),
    [
        (["--skill", "caption"], "--skill detect --object 'circle' -> --skill caption --length 'normal'"),
        (["--skill", "point", "--object", "circle"], "--skill detect"),
        (["--skill", "detect", "--object", "square"], "--object 'circle' -> 'square'"),
        ([*DETECT, "--settings", '{"max_objects": 2}'], '--settings {} -> {"max_objects": 2}'),
        ([*DETECT, "--model", "/elsewhere/checkpoint"], "--model"),
        (["--skill", "caption", "--allow-changed"], "--skill detect"),  # no flag makes another job fit
    ],
)
def test_resuming_another_jobs_file_exits_2_and_changes_no_byte(done_job, capsys, args, differs):
    folder, out = done_job
    before = _snapshot(out)
    assert _cli(folder, out, *args, "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert differs in err and "another --out" in err
    assert _snapshot(out) == before


def test_the_same_job_resumes_from_the_api_or_the_cli(same_lines, model, done_job, capsys):
    folder, out = done_job  # written by batch.run with a loaded model: the CLI's default is that model
    job = batch.run(folder, "detect", object="circle", model=model, out=out, resume=True, progress=False)
    assert job.run().skipped == 4
    assert _cli(folder, out, *DETECT, "--settings", "{}", "--resume") == 0
    assert "(4 already done)" in capsys.readouterr().err
    same_lines(out.read_text().splitlines(), _expected(model, folder))


@pytest.mark.parametrize("change", ["added", "removed", "modified"])
def test_a_changed_input_exits_2_unless_allowed(done_job, capsys, change):
    folder, out = done_job
    paths = sorted(folder.rglob("*.png"))
    if change == "added":
        _modify(folder / "scene0001b.png", 50)
    elif change == "removed":
        paths[1].unlink()
    else:
        _modify(paths[1], 51)
    before = _snapshot(out)
    assert _cli(folder, out, *DETECT, "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"1 {change}" in err and "--allow-changed" in err, err
    assert _snapshot(out) == before


def test_allow_changed_keeps_unchanged_lines_and_redoes_the_rest_in_input_order(same_lines, model, done_job, capsys):
    folder, out = done_job
    paths = sorted(folder.rglob("*.png"))  # scene0001, scene0002, sub/scene0000, sub/scene0003
    _modify(paths[0], 60)
    paths[2].unlink()
    _modify(folder / "scene0001b.png", 61)  # sorts between scene0001 and scene0002
    assert _cli(folder, out, *DETECT, "--resume", "--allow-changed") == 0
    err = capsys.readouterr().err
    assert "2 images in" in err and "(2 already done)" in err, err  # scene0002, sub/scene0003 kept
    same_lines(out.read_text().splitlines(), _expected(model, folder))
    assert _cli(folder, out, *DETECT, "--resume") == 0  # the record now describes the new input
    assert "0 images in" in capsys.readouterr().err


def test_allow_changed_resumes_a_partial_file_too(same_lines, model, done_job):
    folder, out = done_job
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n" + lines[1] + "\n")  # killed after 2 of 4
    _modify(sorted(folder.rglob("*.png"))[3], 62)
    job = batch.run(
        folder,
        "detect",
        object="circle",
        model=model,
        out=out,
        resume=True,
        allow_changed=True,
        progress=False,
    )
    summary = job.run()
    assert (summary.skipped, summary.done) == (2, 2)
    same_lines(out.read_text().splitlines(), _expected(model, folder))


def test_allow_changed_needs_resume(done_job, capsys):
    folder, out = done_job
    assert _cli(folder, out, *DETECT, "--allow-changed") == 2
    assert "--resume" in capsys.readouterr().err


def test_results_without_a_job_record_are_not_resumed(done_job, capsys):
    folder, out = done_job
    job_path(out).unlink()
    before = out.read_bytes()
    assert _cli(folder, out, *DETECT, "--resume") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no job record" in err and "another --out" in err
    assert out.read_bytes() == before


def test_results_stay_one_image_a_line_and_the_job_record_is_beside_them(done_job):
    folder, out = done_job
    whole = out.read_text().splitlines()[:-1]  # the torn tail is not a line yet
    assert len(whole) == 4 and all(
        set(json.loads(line)) in ({"image", "result"}, {"image", "error"}) for line in whole
    )
    record = json.loads(job_path(out).read_text())
    assert record["job"]["skill"] == "detect" and record["job"]["argument"] == "circle"
    assert [key for key, _ in record["input"]["items"]] == [json.loads(line)["image"] for line in whole]


@pytest.mark.parametrize("killed", ["before the record", "before the kept lines"])
def test_a_kill_while_allow_changed_rewrites_resumes_to_the_same_file(same_lines, model, done_job, killed):
    folder, out = done_job
    _modify(sorted(folder.rglob("*.png"))[0], 63)  # the first image: the other 3 lines are carried
    record = job_record(SkillCall.of("detect", object="circle"), model, open_input(folder))
    plan = plan_output(out, record, resume=True, allow_changed=True)
    assert plan.rewrite == [] and len(plan.kept) == 3
    plan.write_record = killed != "before the record"
    open_results(plan).close()  # killed here: no line written again yet
    assert out.read_bytes() == b""
    job = batch.run(
        folder, "detect", object="circle", model=model, out=out, resume=True, progress=False,
        allow_changed=killed == "before the record",  # the old record still names the old input
    )  # fmt: skip
    job.run()
    same_lines(out.read_text().splitlines(), _expected(model, folder))
