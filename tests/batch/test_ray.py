"""`foveal batch --ray` on a local Ray instance (num_cpus=2): the same results file as a local run,
line for line, and a Ray run resumes like a local one."""

from __future__ import annotations

import pytest

from foveal import batch

ray = pytest.importorskip(
    "ray", reason="the Ray tests need Ray Data: pip install -e '.[ray]' in foveal's clone (dev installs it)"
)
pytest.importorskip("ray.data", reason="the Ray tests need Ray Data: pip install -e '.[ray]' in foveal's clone")

from foveal.batch.ray_job import run_on_ray  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_writes_the_local_runs_lines(local_ray, model, scene_folder, same_lines, tmp_path):
    local = tmp_path / "local.jsonl"
    batch.run(scene_folder, "detect", object="circle", model=model, out=local, progress=False).run()
    on_ray = tmp_path / "ray.jsonl"
    first = sorted(str(p) for p in scene_folder.rglob("*.png"))[:5]
    half = tmp_path / "half.txt"
    half.write_text("\n".join(first))

    summary = run_on_ray(scene_folder, "detect", object="circle", out=on_ray, progress=False, window=8)
    same_lines(on_ray.read_text().splitlines(), local.read_text().splitlines())
    assert (summary.done, summary.errors) == (len(local.read_text().splitlines()), 1)

    resumed = tmp_path / "resumed.jsonl"
    run_on_ray(half, "detect", object="circle", out=resumed, progress=False)  # keys: the list's lines
    summary = run_on_ray(half, "detect", object="circle", out=resumed, resume=True, progress=False)
    assert (summary.skipped, summary.done) == (5, 0)
    same_lines(resumed.read_text().splitlines(), local.read_text().splitlines()[:5])


def test_ray_refuses_bad_jobs_before_starting_work(local_ray, scene_folder, tmp_path):
    with pytest.raises(ValueError, match="max_tokens"):
        run_on_ray(scene_folder, "detect", object="x", settings={"max_tokens": -1}, out=tmp_path / "r.jsonl")
    assert not (tmp_path / "r.jsonl").exists()


def test_ray_resume_gets_the_local_checks(local_ray, model, scene_writer, same_lines, tmp_path):
    folder = tmp_path / "images"
    paths = scene_writer(folder, 3)
    out = tmp_path / "r.jsonl"  # a local run's file: the same as a Ray run's (the test above), and faster
    batch.run(folder, "detect", object="circle", model=model, out=out, progress=False).run()
    before = out.read_bytes()
    with pytest.raises(batch.OutputError, match="--skill detect --object 'circle' -> --skill caption"):
        run_on_ray(folder, "caption", out=out, resume=True)
    paths[1].unlink()
    scene_writer(tmp_path / "more", 5)[4].rename(folder / "scene0000b.png")
    (folder / "dangling.png").symlink_to(folder / "gone.png")  # an actor's error line, as a local run's
    with pytest.raises(batch.OutputError, match="2 added.*1 removed.*--allow-changed"):
        run_on_ray(folder, "detect", object="circle", out=out, resume=True)
    assert out.read_bytes() == before

    summary = run_on_ray(
        folder, "detect", object="circle", out=out, resume=True, allow_changed=True, progress=False
    )
    expected = [
        r.to_json() for r in batch.run(folder, "detect", object="circle", model=model, progress=False)
    ]
    same_lines(out.read_text().splitlines(), expected)
    assert (summary.skipped, summary.done, summary.errors) == (2, 2, 1)


def test_ray_reports_invalid_base64_as_the_local_run_does(local_ray, model, tmp_path):
    import base64
    import io
    import json

    from foveal.vision import scenes

    buffer = io.BytesIO()
    scenes.render(scenes.generate_scene(0, 64)).save(buffer, "PNG")
    rows = tmp_path / "rows.jsonl"
    cells = [base64.b64encode(buffer.getvalue()).decode(), "!!not base64!!"]
    rows.write_text(
        "".join(json.dumps({"id": f"r{i}", "image_base64": c}) + "\n" for i, c in enumerate(cells))
    )
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    batch.run(rows, "caption", model=model, out=local, progress=False).run()
    summary = run_on_ray(rows, "caption", out=on_ray, progress=False)
    assert (summary.done, summary.errors) == (2, 1)
    assert on_ray.read_text() == local.read_text()
    assert (
        "line 2 column 'image_base64' is not valid base64"
        in json.loads(on_ray.read_text().splitlines()[1])["error"]["message"]
    )
