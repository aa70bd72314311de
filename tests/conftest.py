"""Fixtures of the whole suite: the SmolLM2 tokenizer and small data slices (both in the repository),
and the path to the full corpora in ../shared, which only conformance tests read.

The default suite needs nothing outside the repository. A test that asks for `shared_dir`
(directly or through another fixture) reads ../shared, so it is a conformance test: it is marked
`conformance` here, runs under `pytest -m conformance`, and skips, saying where it looked, when
../shared is not beside the repository.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from foveal.testing import SMOLLM2_TOKENIZER

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
DATA = ROOT / "tests" / "data"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "shared_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.conformance)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared beside the repository: the full conformance corpora (conformance tests only)."""
    if not SHARED.is_dir():
        pytest.skip(f"conformance corpora not found: {SHARED} (../shared beside the repository) is absent")
    return SHARED


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """tests/data: small slices of the corpora, laid out as in ../shared (with their licence notices)."""
    return DATA


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The SmolLM2 tokenizer folder (49,152 tokens; EOS <|im_end|> = 2), shipped in foveal.testing."""
    return SMOLLM2_TOKENIZER


@pytest.fixture(autouse=True, scope="session")
def _one_decode_thread():
    """Engines decode on one intra-op thread (FOVEAL_DECODE_THREADS, engine/device.py) unless a test
    turns the timed count on: tests compare answers bit for bit, and a count the chooser tries by
    timing could round a step apart in its last bits (tests/engine/test_device.py times it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FOVEAL_DECODE_THREADS", "1")
        yield


@pytest.fixture(autouse=True, scope="session")
def _weight_cache_off():
    """GGUF loads prepare their weights from the file: the weight cache (engine/models/weight_cache.py)
    stays off unless a test turns it on with a folder of its own (tests/models/test_weight_cache.py,
    test_gguf_tiny.py), so that no test writes into the user's ~/.cache/foveal. Session-wide, so
    that module-scoped fixtures' loads are covered too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FOVEAL_WEIGHT_CACHE", "0")
        yield


@pytest.fixture(autouse=True, scope="session")
def _token_table_cache_off():
    """Grammar tokenizer handles read their token tables from the tokenizer's JSON: the token table
    cache (grammars/token_tables.py) stays off unless a test turns it on with a folder of its own
    (tests/grammars/test_token_tables.py), so that no test writes into the user's ~/.cache/foveal."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FOVEAL_TOKENIZER_CACHE", "0")
        yield
