"""Type-check the package: lay out `foveal` as a real folder tree for static tools, then run mypy on it.

PROBLEM: the repository's folders become the import package `foveal` only through pyproject.toml's
`[tool.setuptools.package-dir]` remap (`sdk/` is `foveal`, `engine/` is `foveal.engine`, ...), which
the default editable install serves with an import hook that no static tool follows; a checker or an
editor run on the clone resolves none of the `foveal.*` imports.

SOLUTION: `build/typecheck/foveal/` is a folder of symbolic links: one per entry of `sdk/`, and one per
sub-package folder named by its place in the package (`foveal/engine` -> `engine/`, ...), read from
pyproject.toml's remap so a new sub-package needs no change here. `[tool.mypy]` (and `[tool.pyright]`
for editors) put `build/typecheck` on the search path, so `foveal.*` resolves to the real files; this
script then runs mypy with the arguments it is given and writes each reported path as the real source
file (`engine/engine.py`, not `build/typecheck/foveal/engine/engine.py`).

    python .ci/typecheck.py              # lay out the tree, then run mypy (configured in pyproject.toml)
    python .ci/typecheck.py --layout     # only lay out the tree (for an editor); rerun after a new file in sdk/

INVARIANTS: the tree is rebuilt on every run (stale links go); nothing outside `build/typecheck` is
written; the exit status is mypy's (non-zero on any error).
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"
# a reported location: `path.py:12: error: ...` or `path.py:12:5: note: ...`
LOCATION = re.compile(r"^(?P<path>[^\s:]+\.pyi?)(?P<rest>:\d+)")


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """The remap of pyproject.toml: import name -> folder (`{"foveal": "sdk", "foveal.engine": "engine"}`)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    return dict(config["tool"]["setuptools"]["package-dir"])


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent), target_is_directory=target.is_dir())


def _clear(folder: Path) -> None:
    """Remove a previous tree: links are unlinked (never followed), real folders emptied then removed."""
    if not folder.exists() and not folder.is_symlink():
        return
    if folder.is_symlink() or not folder.is_dir():
        folder.unlink()
        return
    for entry in folder.iterdir():
        _clear(entry)
    folder.rmdir()


def layout(root: Path = ROOT, tree: Path = TREE) -> Path:
    """Build `tree/foveal` (links to the real folders) and return `tree`, the folder to put on the path."""
    dirs = package_dirs(root)
    _clear(tree)
    top = tree / "foveal"
    top.mkdir(parents=True)
    sub = {name.removeprefix("foveal.") for name in dirs if name != "foveal"}
    for entry in sorted((root / dirs["foveal"]).iterdir()):
        if entry.name != "__pycache__" and entry.name not in sub:
            _link(top / entry.name, entry)
    for name, folder in sorted(dirs.items()):
        if name != "foveal":
            _link(tree / Path(*name.split(".")), root / folder)
    return tree


def real_paths(text: str, root: Path = ROOT) -> str:
    """Rewrite each reported location (relative to the working folder, or absolute) inside the link tree
    as the real source file, relative to `root`."""

    def real(match: re.Match[str]) -> str:
        resolved = Path(os.path.realpath(match["path"]))
        if resolved.is_relative_to(root):
            return f"{resolved.relative_to(root)}{match['rest']}"
        return match[0]

    return "\n".join(LOCATION.sub(real, line) for line in text.split("\n"))


def main(argv: list[str]) -> int:
    layout()
    if argv[:1] == ["--layout"]:
        print(f"laid out {TREE.relative_to(ROOT)}/foveal")
        return 0
    from mypy import api

    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), *argv])
    sys.stdout.write(real_paths(stdout))
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
