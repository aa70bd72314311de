"""The layering the design fixes: every package imports only the packages below it, and nothing
below the families (nor the SDK, the server or batch) names a model family; families are plugins.

Read from the sources (AST, docstrings and comments left out), so a family name that creeps into a
comparison, a dict key or an import of a family's own module fails here. The family names come from
the registry (`foveal.families`), so a new family is covered the day it is registered; the packages
come from pyproject.toml, so a new package must say here which packages it may import.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

import foveal
from foveal import families
from foveal.families.base import ALL_SKILLS, Family

ROOT = Path(foveal.__file__).resolve().parent.parent
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
FOLDERS = {folder: name for name, folder in PACKAGE_DIRS.items()}  # "sdk" -> "foveal", "engine" -> "foveal.engine"


def _model_type(architecture: str) -> str:
    """A config.json architecture's model type: `Qwen2_5_VLForConditionalGeneration` -> `qwen2_5_vl`."""
    return re.sub(r"^Hf|For(ConditionalGeneration|CausalLM)$", "", architecture).lower()


def _family_names() -> set[str]:
    """Every name a registered family goes by: its own, its architectures' (each `Architecture` of its
    table, each config.json architecture's model type) and its folder's. A skill's name ("chat", the
    folder of the chat models) is a skill wherever it appears, not a family."""
    names = set()
    for family in families.FAMILIES:
        names.add(family.name)
        names.update(arch.name for arch in getattr(family, "table", ()))
        names.update(_model_type(arch) for arch in family.architectures)
        names.add(family.__module__.split(".")[2])
    return names - {"base"} - set(ALL_SKILLS)


FAMILY_NAMES = _family_names()
# Building blocks that read a file format's or a module's own names, not a family's: a GGUF file names
# its architecture "llama" in its metadata; the lean forward tells Gemma-style layers by their class;
# the server's Moondream REST API tags its routes with the API's name (any family answers them).
FORMAT_NAMES = {
    "engine/models/gguf.py": {"llama"},
    "engine/models/lean.py": {"gemma"},
    "server/moondream_api.py": {"moondream"},
}
# The family contract, which the SDK reads every family through (no family's own module).
GENERIC = {
    "foveal.families",
    "foveal.families.base",
    "foveal.families.task",
    "foveal.families.conversation",
    "foveal.families.prepared",
}
# What each package may import (besides itself and foveal._guard): the design's one-way arrows,
# server, batch -> sdk -> families -> engine, grammars, vision; engine -> grammars (the Matcher
# protocol); grammars and vision -> nothing. Test helpers and training sit beside the SDK.
BELOW_SDK = {"families", "engine", "grammars", "vision"}
MAY_IMPORT = {
    "grammars": set(),
    "vision": set(),
    "engine": {"grammars"},
    "families": {"engine", "grammars", "vision"},
    "sdk": BELOW_SDK,
    "server": {"sdk", "engine", "grammars", "vision"},
    "batch": {"sdk", "engine", "grammars", "vision"},
    "testing": {"sdk", *BELOW_SDK},
    "training": {"sdk", "testing", *BELOW_SDK},
}
# The `foveal` command dispatches to its `serve` and `batch` sub-commands (imported when they run).
MAY_IMPORT_TOO = {"sdk/cli.py": {"server", "batch"}}
# Packages whose code names no family: everything but the families themselves and the helpers that
# build and evaluate their checkpoints.
NAME_NO_FAMILY = ("sdk", "engine", "grammars", "vision", "server", "batch")


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:-1]]
    return ".".join(parts if rel.stem == "__init__" else [*parts, rel.stem])


def _package_of(module: str) -> str | None:
    """The top-level folder a foveal module lives in; None for foveal._guard (every package's)."""
    if module == "foveal._guard":
        return None
    for name, folder in sorted(PACKAGE_DIRS.items(), key=lambda item: -len(item[0])):
        if name != "foveal" and (module == name or module.startswith(name + ".")):
            return folder
    return "sdk"


def _code_strings_and_imports(path: Path) -> tuple[list[str], list[str]]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    strings = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]
    module = _module_of(path)
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from foveal import grammars` imports the package foveal.grammars, not the SDK
            packages = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in PACKAGE_DIRS]
            imports += packages if len(packages) == len(node.names) else [base, *packages]
    return strings, [m for m in imports if m]


def _sources(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


def _ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_family_names_come_from_every_registered_family():
    # the families registered since the list was kept by hand are in it, and so are the older ones
    assert {"gemma4", "molmo2", "qwen3_5", "qwen2_5_vl", "qwen3_vl", "paligemma", "moondream", "llama"} <= FAMILY_NAMES
    for family in families.FAMILIES:
        assert {_model_type(arch) for arch in family.architectures} <= FAMILY_NAMES | set(ALL_SKILLS)


def test_every_package_declares_what_it_may_import():
    assert set(MAY_IMPORT) == set(FOLDERS), "a package in pyproject.toml without its row in MAY_IMPORT, or the reverse"


@pytest.mark.parametrize("path", _sources(*NAME_NO_FAMILY), ids=_ids)
def test_no_package_below_the_families_nor_the_sdk_names_a_family(path):
    strings, imports = _code_strings_and_imports(path)
    allowed = FORMAT_NAMES.get(_ids(path), set())
    named = [s for s in strings if s.lower() in FAMILY_NAMES - allowed]
    assert not named, f"{path.name} names a family: {named}"
    own = [m for m in imports if m.startswith("foveal.families") and m not in GENERIC]
    assert not own, f"{path.name} imports a family's own module: {own}"


@pytest.mark.parametrize("path", _sources(*FOLDERS), ids=_ids)
def test_every_package_imports_only_the_packages_below_it(path):
    _, imports = _code_strings_and_imports(path)
    own = path.relative_to(ROOT).parts[0]
    allowed = {own} | MAY_IMPORT[own] | MAY_IMPORT_TOO.get(_ids(path), set())
    bad = [m for m in imports if m.split(".")[0] == "foveal" and _package_of(m) not in allowed | {None}]
    assert not bad, f"{_ids(path)} imports {bad}: {own} may import only {sorted(allowed - {own}) or 'no other package'}"


@pytest.mark.parametrize("path", _sources(*(folder for folder in FOLDERS if folder != "grammars")), ids=_ids)
def test_only_the_grammars_import_llguidance(path):
    """Grammars hold the mechanisms; a family's answer format or the SDK's tools build on them."""
    _, imports = _code_strings_and_imports(path)
    assert not [m for m in imports if m.split(".")[0] == "llguidance"], f"{_ids(path)} imports llguidance"


def test_the_engine_imports_no_family_and_no_sdk():
    for path in _sources("engine"):
        _, imports = _code_strings_and_imports(path)
        bad = [
            m
            for m in imports
            if m.startswith("foveal.")
            and not m.startswith(("foveal.engine", "foveal.grammars", "foveal._guard"))
        ]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the engine depends on grammars only"


def test_every_registered_family_is_a_plugin_with_declared_skills():
    assert families.FAMILIES and all(issubclass(f, Family) for f in families.FAMILIES)
    archs = families.supported_architectures()
    assert len(archs) == len(set(archs))
    for family in families.FAMILIES:
        assert family.architectures, f"{family.__name__} declares no architectures"
