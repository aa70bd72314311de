"""MkDocs hook: lets mkdocstrings read foveal's sources as the one package `foveal`.

The repository's top-level folders are installed as sub-packages of `foveal` (`sdk/` as `foveal`,
`engine/` as `foveal.engine`, ...: pyproject.toml's package-dir). griffe, which reads the sources for
the API reference, finds a package in one folder and its sub-packages inside it, so it would see
`foveal` (sdk/) without `foveal.engine`. This hook lays out a temporary tree in which they are nested
as they are once installed (`foveal/` holds links to sdk/'s files and to each mapped folder), and puts
it first on the search path. Nothing is imported: the reference is read from the source text.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source_tree(root: Path = ROOT) -> Path:
    """A temporary folder whose `foveal/` is the installed package's layout, made of links into `root`."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    tree = Path(tempfile.mkdtemp(prefix="foveal-docs-"))
    atexit.register(shutil.rmtree, tree, True)
    package = tree / "foveal"
    package.mkdir()
    for entry in (root / mapping["foveal"]).iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        if name != "foveal":
            (package / name.removeprefix("foveal.")).symlink_to(root / folder)
    return tree


def on_startup(command: str, dirty: bool) -> None:
    sys.path.insert(0, str(source_tree()))
