"""Fixtures of the benchmark smoke tests: `benchmarks` importable (it is not part of the package), a tiny model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the repository root there
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Llama with SmolLM2's tokenizer, loaded by foveal and by transformers."""
    from benchmarks import peers
    from foveal.engine import models

    if not peers.SMOLLM2_TOKENIZER.is_dir():
        pytest.skip(f"SmolLM2 tokenizer not found at {peers.SMOLLM2_TOKENIZER}")
    folder = peers.tiny_llama_folder(tmp_path_factory.mktemp("tiny"))
    return folder, models.load(folder, device="cpu"), peers.reference_model(folder)
