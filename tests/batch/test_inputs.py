"""INPUT resolution: folders, globs, list files, JSONL and Parquet tables, and the refusals before work."""

from __future__ import annotations

import base64
import json

import pytest

from foveal.batch import InputError, input_of_images, open_input


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ("a.png", "b/c.JPG", "b/d.webp", "z.png"):
        (tmp_path / name).write_bytes(name.encode())
    (tmp_path / "readme.md").write_text("x")
    return tmp_path


def _sources(found):
    return [s if isinstance(s, bytes) else str(s) for s in found.sources()]


def test_a_folder_is_every_image_file_under_it_sorted(folder):
    found = open_input(folder)
    assert found.keys == [str(folder / n) for n in ("a.png", "b/c.JPG", "b/d.webp", "z.png")]
    assert _sources(found) == found.keys


def test_a_glob_is_the_files_it_matches(folder):
    found = open_input(f"{folder}/**/*.png")
    assert found.keys == [str(folder / "a.png"), str(folder / "z.png")]


def test_a_list_file_resolves_relative_paths_beside_it(folder):
    listing = folder / "list.txt"
    listing.write_text("# photos\nz.png\n\nb/c.JPG\n")
    found = open_input(listing)
    assert found.keys == ["z.png", "b/c.JPG"]  # keys as written
    assert _sources(found) == [str(folder / "z.png"), str(folder / "b/c.JPG")]


def test_jsonl_with_paths_and_with_base64_bytes(folder):
    paths = folder / "rows.jsonl"
    paths.write_text(
        json.dumps({"path": "a.png", "id": "first"}) + "\n" + json.dumps({"path": "z.png", "id": 2}) + "\n"
    )
    found = open_input(paths)
    assert found.keys == ["first", "2"]
    assert _sources(found) == [str(folder / "a.png"), str(folder / "z.png")]
    encoded = folder / "bytes.jsonl"
    encoded.write_text(
        "\n".join(json.dumps({"image_bytes": base64.b64encode(b).decode()}) for b in (b"x", b"y"))
    )
    found = open_input(encoded)
    assert found.keys == ["row-0", "row-1"] and _sources(found) == [b"x", b"y"]


def test_parquet_with_paths_bytes_and_image_structs(folder):
    pa = pytest.importorskip(
        "pyarrow", reason="Parquet inputs need pyarrow (the dev and ray extras install it)"
    )
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": ["a.png", "z.png"]}), folder / "paths.parquet")
    found = open_input(folder / "paths.parquet")
    assert found.keys == ["a.png", "z.png"] and _sources(found) == [
        str(folder / "a.png"),
        str(folder / "z.png"),
    ]
    pq.write_table(pa.table({"key": ["k1", "k2"], "image": [b"x", b"y"]}), folder / "bytes.parquet")
    found = open_input(folder / "bytes.parquet")
    assert found.keys == ["k1", "k2"] and _sources(found) == [b"x", b"y"]
    structs = pa.table({"img": [{"bytes": b"x", "path": "p"}, {"bytes": None, "path": "a.png"}]})
    pq.write_table(structs, folder / "hf.parquet")
    found = open_input(folder / "hf.parquet", column="img")
    assert found.keys == ["row-0", "row-1"] and _sources(found) == [b"x", str(folder / "a.png")]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "holds no image files"),
        (lambda d: f"{d}/*.gif", "matches no file"),
        (lambda d: (d / "l.txt").write_text("a.png\na.png\n") and d / "l.txt", "names 'a.png' twice"),
        (lambda d: (d / "r.jsonl").write_text('{"x": 1}\n') and d / "r.jsonl", "has no image column"),
        (lambda d: (d / "e.txt").write_text("\n# nothing\n") and d / "e.txt", "lists no image paths"),
    ],
)
def test_unusable_input_is_refused_with_what_to_fix(tmp_path, make, message):
    with pytest.raises(InputError, match=message):
        open_input(make(tmp_path))


def test_images_given_in_python_get_keys():
    found = input_of_images(["a.png", b"bytes"])
    assert found.keys == ["a.png", "1"]
    assert input_of_images({"x": b"1"}).keys == ["x"]
    with pytest.raises(InputError, match="no images"):
        input_of_images([])
