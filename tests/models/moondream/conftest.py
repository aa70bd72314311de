"""Fixtures of the Moondream tests: the reference fixture folder in ../shared (conformance only) and its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def md_dir(shared_dir: Path) -> Path:
    folder = shared_dir / "fixtures" / "moondream2-tiny"
    if not folder.is_dir():
        pytest.skip(f"the Moondream fixture is absent: {folder}")
    return folder


@pytest.fixture(scope="session")
def md_figures(md_dir: Path) -> dict:
    return json.loads((md_dir / "figures.json").read_text())


@pytest.fixture(scope="session")
def md_tensors(md_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(md_dir / "figures.safetensors")


def tolerance(ref) -> float:
    """The fixture README's float tolerance: 1e-4 * max(1, max |ref|)."""
    return 1e-4 * max(1.0, float(ref.abs().max()))


@pytest.fixture(scope="session")
def md3_dir(shared_dir: Path) -> Path:
    """The Moondream 3 (preview) tiny reference fixture (test_md3_*.py)."""
    folder = shared_dir / "fixtures" / "moondream3-tiny"
    if not folder.is_dir():
        pytest.skip(f"the Moondream 3 fixture is absent: {folder}")
    return folder
