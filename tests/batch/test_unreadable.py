"""Entries of a folder INPUT that cannot be read (a dangling link, a link loop, a file or a sub-folder
without read permission) are listed in their place and become error lines, never skipped."""

from __future__ import annotations

import os
import shutil

import pytest

from foveal import batch
from foveal.batch import open_input


@pytest.fixture
def folder(scene_writer, tmp_path, monkeypatch):
    folder = tmp_path / "images"
    good = scene_writer(folder, 2)  # scene0001.png, sub/scene0000.png
    (folder / "a_dangling.png").symlink_to(folder / "gone.png")
    (folder / "b_loop.png").symlink_to(folder / "b_loop.png")
    denied = folder / "c_denied.png"
    shutil.copy(good[1], denied)
    locked = folder / "locked"
    locked.mkdir()
    shutil.copy(good[1], locked / "inside.png")
    # The tests run as root, whom chmod 000 does not stop: deny what it would deny another user.
    access, scandir = os.access, os.scandir

    def no_read(path, mode, **kwargs):
        return False if os.fspath(path) == str(denied) and mode & os.R_OK else access(path, mode, **kwargs)

    def no_listing(path="."):
        if os.fspath(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(locked))
        return scandir(path)

    monkeypatch.setattr(os, "access", no_read)
    monkeypatch.setattr(os, "scandir", no_listing)
    return folder


NAMES = ["a_dangling.png", "b_loop.png", "c_denied.png", "locked", "scene0001.png", "sub/scene0000.png"]


def test_a_folder_lists_its_unreadable_entries_in_order(folder):
    assert open_input(folder).keys == [str(folder / name) for name in NAMES]


def test_a_glob_lists_dangling_links_and_loops(folder):
    assert open_input(f"{folder}/*.png").keys == [str(folder / name) for name in NAMES[:3] + NAMES[4:5]]


def test_unreadable_entries_become_error_lines_in_their_place(model, folder, tmp_path):
    out = tmp_path / "r.jsonl"
    records = list(batch.run(folder, "detect", object="circle", model=model, out=out, progress=False))
    assert [r.image for r in records] == [str(folder / name) for name in NAMES]
    assert [r.to_json() for r in records] == out.read_text().splitlines()
    errors = {r.image.rsplit("/", 1)[-1]: r.error for r in records[:4]}
    assert all(error["type"] == "ImageError" for error in errors.values()), errors
    assert "dangling symbolic link" in errors["a_dangling.png"]["message"]
    assert "symbolic link loop" in errors["b_loop.png"]["message"]
    assert "permission denied" in errors["c_denied.png"]["message"]
    assert "cannot be listed" in errors["locked"]["message"]
    assert all(r.ok for r in records[4:])
