"""Fixtures of the batch tests: a folder of shapes scenes (plus one unreadable file) and the embedded model."""

from __future__ import annotations

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
