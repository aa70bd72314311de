""".ci/typecheck.py: the link tree resolves `foveal.*` to the real folders, reported paths are the real
files, and a type error makes it exit non-zero (so `.ci/run`, under `set -e`, fails)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("typecheck", ROOT / ".ci" / "typecheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _repo(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"foveal" = "sdk"\n"foveal.engine" = "engine"\n'
    )
    for folder in ("sdk", "engine/models"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "sdk" / "__init__.py").write_text("")
    (tmp_path / "sdk" / "model.py").write_text("")
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "models" / "gguf.py").write_text("")
    return tmp_path


def test_the_tree_maps_each_folder_to_its_import_name(tmp_path):
    typecheck = _script()
    root = _repo(tmp_path)
    tree = typecheck.layout(root, root / "build" / "typecheck")
    assert (tree / "foveal" / "model.py").resolve() == root / "sdk" / "model.py"
    assert (
        tree / "foveal" / "engine" / "models" / "gguf.py"
    ).resolve() == root / "engine" / "models" / "gguf.py"
    (root / "sdk" / "model.py").unlink()  # a second layout drops the stale link and keeps the sources
    typecheck.layout(root, tree)
    assert not (tree / "foveal" / "model.py").is_symlink()
    assert (root / "engine" / "models" / "gguf.py").exists()


def test_reported_paths_are_the_real_files(tmp_path, monkeypatch):
    typecheck = _script()
    root = _repo(tmp_path)
    monkeypatch.chdir(root)
    typecheck.layout(root, root / "build" / "typecheck")
    report = "build/typecheck/foveal/engine/models/gguf.py:12: error: no  [misc]\nFound 1 error"
    assert typecheck.real_paths(report, root) == "engine/models/gguf.py:12: error: no  [misc]\nFound 1 error"


def test_a_type_error_fails_the_check(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text('x: int = "one"\n')
    assert _script().main([str(bad), "--no-incremental"]) != 0
    assert "Incompatible types in assignment" in capsys.readouterr().out
