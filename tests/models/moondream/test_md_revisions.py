"""Moondream 2 revisions: a folder of a revision foveal does not implement is refused before its weights
are read, naming what was found and what is supported; never read with the wrong rules."""

from __future__ import annotations

import json

import pytest

import foveal
from foveal.engine.models import ModelLoadError
from foveal.families.moondream import revisions

REAL_CONFIG = {"architectures": ["HfMoondream"], "model_type": "moondream1", "config": {}}


def _files(folder):
    """config.json of the real repo and a weights file that is never read (the refusal comes first)."""
    (folder / "config.json").write_text(json.dumps(REAL_CONFIG))
    (folder / "model.safetensors").write_bytes(b"not read")
    (folder / "tokenizer.json").write_text("{}")


def _snapshot(tmp_path, ref: str):
    """A hub-cache layout: models--vikhyatk--moondream2/{refs/<ref>, snapshots/<commit>/config.json}."""
    repo = tmp_path / "models--vikhyatk--moondream2"
    folder = repo / "snapshots" / "0123abcd"
    folder.mkdir(parents=True)
    _files(folder)
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text("0123abcd")
    return folder


def test_an_older_revision_in_the_hub_cache_is_refused(tmp_path):
    folder = _snapshot(tmp_path, "2025-01-09")
    with pytest.raises(ModelLoadError, match=r"revision 2025-01-09 \(hub cache ref 2025-01-09\).*2025-06-21"):
        foveal.load(folder, device="cpu")


def test_older_remote_code_is_refused(tmp_path):
    _files(tmp_path)
    (tmp_path / "config.py").write_text("class TokenizerConfig:\n    eos_id: int = 50256\n")
    with pytest.raises(ModelLoadError, match=r"pre-starmie revision.*2025-06-21"):
        foveal.load(tmp_path, device="cpu")


def test_the_implemented_revision_is_recognised(tmp_path):
    folder = _snapshot(tmp_path, "2025-06-21")
    assert revisions.check(folder, {}) == "2025-06-21"
    starmie = tmp_path / "plain"
    starmie.mkdir()
    (starmie / "config.py").write_text('TOKENIZER = "moondream/starmie-v1"\n')
    assert revisions.check(starmie, {}) == "2025-06-21"
    assert revisions.check(tmp_path / "nothing", {}) is None  # a plain folder: its config.json's rules


def test_pinned_revisions(tmp_path):
    folder = _snapshot(tmp_path, "2025-06-21")
    assert revisions.check(folder, {}, pinned="2025-06-21") == "2025-06-21"
    with pytest.raises(ModelLoadError, match=r"revision '2025-04-14' is not implemented; foveal supports 2025-06-21"):
        revisions.check(folder, {}, pinned="2025-04-14")
