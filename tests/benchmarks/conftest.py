"""Fixtures of the benchmark smoke tests: `benchmarks` importable (it is not part of the package), a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the repository root there
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A random 2-layer Llama checkpoint folder with SmolLM2's tokenizer (benchmarks.peers' --quick model)."""
    from benchmarks import peers

    return peers.tiny_llama_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_loaded(tiny_folder):
    """The tiny Llama loaded by foveal.engine.models, as the pipelining sections run it."""
    from foveal import families

    return families.load(tiny_folder, device="cpu")
