"""The layering the design fixes: the SDK and the engine never name a model family; families are plugins.

Read from the sources (AST, docstrings and comments left out), so a family name that creeps into a
comparison, a dict key or an import of a family's own module fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import foveal
from foveal import families
from foveal.families.base import Family

ROOT = Path(foveal.__file__).resolve().parent.parent
FAMILY_NAMES = {
    "moondream",
    "shapes",
    "paligemma",
    "qwen2_5_vl",
    "qwen3_vl",
    "llama",
    "gemma",
    "idefics3",
    "smolvlm",
    "llava",
}
# Building blocks that read a file format's or a module's own names, not a family's: a GGUF file names
# its architecture "llama" in its metadata; the lean forward tells Gemma-style layers by their class.
FORMAT_NAMES = {"engine/models/gguf.py": {"llama"}, "engine/models/lean.py": {"gemma"}}
GENERIC = {"foveal.families", "foveal.families.base", "foveal.families.task", "foveal.families.conversation"}


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
    imports = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    imports += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    return strings, imports


def _sources(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


@pytest.mark.parametrize("path", _sources("sdk", "engine"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_sdk_and_the_engine_name_no_family(path):
    strings, imports = _code_strings_and_imports(path)
    allowed = FORMAT_NAMES.get(str(path.relative_to(ROOT)), set())
    named = [s for s in strings if s.lower() in FAMILY_NAMES - allowed]
    assert not named, f"{path.name} names a family: {named}"
    own = [m for m in imports if m.startswith("foveal.families") and m not in GENERIC]
    assert not own, f"{path.name} imports a family's own module: {own}"


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
