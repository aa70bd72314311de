"""`foveal batch --ray` on a local Ray instance (num_cpus=2): the same results file as a local run,
line for line, and a Ray run resumes like a local one."""

from __future__ import annotations

import pytest

from foveal import batch

ray = pytest.importorskip(
    "ray", reason="the Ray tests need Ray Data: pip install 'foveal[ray]' (dev installs it)"
)
pytest.importorskip("ray.data", reason="the Ray tests need Ray Data: pip install 'foveal[ray]'")

from foveal.batch.ray_job import run_on_ray  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_writes_the_local_runs_lines(local_ray, model, scene_folder, tmp_path):
    local = tmp_path / "local.jsonl"
    batch.run(scene_folder, "detect", object="circle", model=model, out=local, progress=False).run()
    on_ray = tmp_path / "ray.jsonl"
    first = sorted(str(p) for p in scene_folder.rglob("*.png"))[:5]
    half = tmp_path / "half.txt"
    half.write_text("\n".join(first))

    summary = run_on_ray(scene_folder, "detect", object="circle", out=on_ray, progress=False, window=8)
    assert on_ray.read_text() == local.read_text()
    assert (summary.done, summary.errors) == (len(local.read_text().splitlines()), 1)

    resumed = tmp_path / "resumed.jsonl"
    run_on_ray(half, "detect", object="circle", out=resumed, progress=False)  # keys: the list's lines
    summary = run_on_ray(half, "detect", object="circle", out=resumed, resume=True, progress=False)
    assert (summary.skipped, summary.done) == (5, 0)
    assert resumed.read_text().splitlines() == local.read_text().splitlines()[:5]


def test_ray_refuses_bad_jobs_before_starting_work(local_ray, scene_folder, tmp_path):
    with pytest.raises(ValueError, match="max_tokens"):
        run_on_ray(scene_folder, "detect", object="x", settings={"max_tokens": -1}, out=tmp_path / "r.jsonl")
    assert not (tmp_path / "r.jsonl").exists()
