"""Fixtures for the model tests, over `foveal.testing.tiny` (the checkpoints) and `.parity` (the checks).

Nothing is downloaded: each family's checkpoint is built from a small config with random weights,
saved with its tokenizer and processor to a temporary folder, and loaded back through
`foveal.engine.models.load` exactly as a user's folder would be.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from foveal.testing import tiny


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny checkpoint folder, built once per test session."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: tiny.build(family, root / family) for family in tiny.BUILDERS}
