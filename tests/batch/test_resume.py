"""A `foveal batch` process killed with SIGKILL mid-run, then resumed, leaves exactly one line per
image, in input order, equal to an uninterrupted run's (batch/writer.py invariant 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from foveal import batch

N_IMAGES = 160  # long enough (several seconds) to be killed mid-run


def _command(folder, out, *extra):
    code = "import sys; from foveal.cli import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", code, "batch", str(folder), "--skill", "detect", "--object", "shape",
            "--out", str(out), "--device", "cpu", "--quiet", *extra]  # fmt: skip


def _lines_now(out) -> int:
    return out.read_bytes().count(b"\n") if out.exists() else 0


def test_a_run_killed_mid_way_resumes_to_one_line_per_image(model, scene_writer, same_lines, tmp_path):
    folder = tmp_path / "images"
    scene_writer(folder, N_IMAGES)
    out = tmp_path / "r.jsonl"
    process = subprocess.Popen(_command(folder, out), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _lines_now(out) < 10 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    killed_at = _lines_now(out)
    assert 10 <= killed_at < N_IMAGES, f"the kill did not land mid-run ({killed_at} lines)"
    with out.open("ab") as torn:  # as if the kill had cut the next line mid-write
        torn.write(b'{"image": "' + str(folder).encode() + b"/scene01")

    resumed = subprocess.run(_command(folder, out, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"({killed_at} already done)" in resumed.stderr

    lines = out.read_text().splitlines()
    expected = [r.to_json() for r in batch.run(folder, "detect", object="shape", model=model, progress=False)]
    assert len(lines) == N_IMAGES
    same_lines(lines, expected)  # one line per image, in input order, the uninterrupted run's
    assert len({json.loads(line)["image"] for line in lines}) == N_IMAGES
