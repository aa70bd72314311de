"""Fixtures of the batch tests: a folder of shapes scenes (plus one unreadable file) and the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import foveal
from foveal.vision import scenes

N_SCENES = 24


def write_scenes(folder: Path, n: int, size: int = 64) -> list[Path]:
    """n scenes as PNGs, every third in a sub-folder (a folder INPUT is recursive)."""
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    paths = []
    for seed in range(n):
        path = folder / ("sub" if seed % 3 == 0 else "") / f"scene{seed:04d}.png"
        scenes.render(scenes.generate_scene(seed, size)).save(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def scene_writer():
    """`write_scenes(folder, n)`, for tests that need a folder of their own."""
    return write_scenes


@pytest.fixture(scope="session")
def scene_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("scenes")
    write_scenes(folder, N_SCENES)
    (folder / "broken.png").write_bytes(b"not a png")  # an unreadable image: an error line
    (folder / "notes.txt").write_text("not an image")  # not an image extension: not an input
    return folder


@pytest.fixture(scope="session")
def model():
    loaded = foveal.load(device="cpu")
    yield loaded
    loaded.close()


def _unscored(line: str) -> tuple[dict, list[float]]:
    """A result line without its items' scores, and those scores in order."""
    record = json.loads(line)
    scores = []
    for key in ("objects", "points"):
        for item in (record.get("result") or {}).get(key, []):
            scores.append(item.pop("score"))
    return record, scores


@pytest.fixture(scope="session")
def same_lines():
    """`same_lines(got, expected)`: result lines equal, scores within 1e-3. A score is read from logits
    whose last bits depend on the batch a call shared (batched matrix products), so a score at a
    rounding boundary of its 4 decimals can differ between two runs whose tokens are identical."""

    def check(got: list[str], expected: list[str]) -> None:
        assert len(got) == len(expected)
        for index, (a, b) in enumerate(zip(got, expected, strict=True)):
            (ra, sa), (rb, sb) = _unscored(a), _unscored(b)
            assert ra == rb, f"line {index}: {a} != {b}"
            assert sa == pytest.approx(sb, abs=1e-3), f"line {index}: scores {sa} != {sb}"

    return check
