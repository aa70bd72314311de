"""Fixtures of the grammar tests: the real SmolLM2 tokenizer (`smollm2_dir`, tests/conftest.py), with and
without loc tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer


@pytest.fixture(scope="session")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def loc_tok(smollm2_dir: Path) -> Tokenizer:
    """SmolLM2 plus 1024 `<locNNNN>` special tokens (ids 49152..50175), as a PaliGemma-style model has."""
    t = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    t.add_special_tokens([f"<loc{k:04d}>" for k in range(1024)])
    return t
