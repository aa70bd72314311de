"""The distribution maps the repository's folders onto one import package, `foveal`."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import foveal
import foveal.testing

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "foveal": "sdk",
    "foveal.batch": "batch",
    "foveal.engine": "engine",
    "foveal.families": "families",
    "foveal.grammars": "grammars",
    "foveal.server": "server",
    "foveal.testing": "testing",
    "foveal.training": "training",
    "foveal.vision": "vision",
}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_subpackages_import_under_foveal():
    for name, folder in FOLDERS.items():
        module = importlib.import_module(name)
        assert Path(module.__file__).parent == ROOT / folder


@pytest.mark.parametrize("bare", ["sdk", "engine", "families", "grammars", "testing", "training", "vision"])
def test_bare_names_do_not_import_outside_the_repo(bare, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", f"import {bare}"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "ModuleNotFoundError" in result.stderr


@pytest.mark.parametrize("bare", ["engine", "families", "grammars", "testing", "training", "vision"])
def test_bare_names_are_refused_from_the_repo_root(bare):
    result = subprocess.run(
        [sys.executable, "-c", f"import {bare}"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert f"import foveal.{bare}" in result.stderr


def test_every_package_folder_is_listed_in_pyproject():
    config = _pyproject()["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for prefix, folder in FOLDERS.items():
        assert mapping[prefix] == folder
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([prefix, *rel.parts]))
    # sub-packages are reached through their parent's mapping, so only the roots need mapping
    assert found == listed, f"pyproject packages differ from the folders: {sorted(found ^ listed)}"


def test_wheel_holds_only_the_foveal_package(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("foveal-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"foveal", f"foveal-{foveal.__version__}.dist-info"}
    for sub in ("engine", "grammars", "testing", "training", "vision"):
        assert f"foveal/{sub}/__init__.py" in names
    tokenizer = Path(foveal.testing.__file__).parent / "data" / "smollm2"
    assert {"tokenizer.json", "NOTICE", "LICENSE"} <= {p.name for p in tokenizer.iterdir()}
    assert sorted(n.split("/")[-1] for n in names if n.startswith("foveal/testing/data/smollm2/")) == sorted(
        p.name for p in tokenizer.iterdir()
    )  # the SmolLM2 tokenizer the tests read travels with its licence
    shipped = sorted(p.name for p in (Path(foveal.__file__).parent / "embedded").iterdir())
    assert "model.safetensors" in shipped  # the embedded model's weights travel in the wheel
    assert sorted(n.split("/")[-1] for n in names if n.startswith("foveal/embedded/")) == shipped


def test_cli_version_and_help():
    out = subprocess.run(
        [sys.executable, "-m", "foveal", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"foveal {foveal.__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "foveal", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: foveal" in out.stdout
