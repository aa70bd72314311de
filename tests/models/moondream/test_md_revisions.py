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


def _cache_with_two_revisions(tmp_path, monkeypatch):
    """A hub cache where `main` and the tag 2025-01-09 are two snapshots of vikhyatk/moondream2."""
    repo = tmp_path / "models--vikhyatk--moondream2"
    for commit, ref in (("aaaa1111", "main"), ("bbbb2222", "2025-01-09")):
        folder = repo / "snapshots" / commit
        folder.mkdir(parents=True)
        _files(folder)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo


def test_a_pinned_revision_selects_its_snapshot_and_an_unimplemented_one_is_refused(tmp_path, monkeypatch):
    from foveal.engine.models.loader import resolve_source

    repo = _cache_with_two_revisions(tmp_path, monkeypatch)
    assert resolve_source("vikhyatk/moondream2") == repo / "snapshots" / "aaaa1111"
    assert resolve_source("vikhyatk/moondream2", "2025-01-09") == repo / "snapshots" / "bbbb2222"
    with pytest.raises(ModelLoadError, match=r"revision '2025-01-09' is not implemented; foveal supports 2025-06-21"):
        foveal.load("vikhyatk/moondream2", revision="2025-01-09", device="cpu")
    with pytest.raises(ModelLoadError, match=r"at revision '2025-06-21' is not in the Hugging Face cache.*--revision"):
        foveal.load("vikhyatk/moondream2", revision="2025-06-21", device="cpu")


def test_a_revision_other_families_cannot_check_is_refused_on_a_local_folder(tmp_path):
    with pytest.raises(ModelLoadError, match=r"revision='v1' cannot be checked on the local folder .*shapes"):
        foveal.load(revision="v1", device="cpu")  # the embedded shapes model's folder
    for bad in ("", 3):
        with pytest.raises(ModelLoadError, match="revision must be"):
            foveal.load(revision=bad, device="cpu")
