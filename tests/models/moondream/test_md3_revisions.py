"""Moondream 3's layout check (revisions.check3): the preview's Hugging Face layout with or without the
region LayerNorm is named, Moondream's engine's (kestrel's) training layout is refused before any weight
is read, naming what the file holds; Moondream 2's names are left to Moondream 2's checks. On the real
layout built on the meta device, and on tiny files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import foveal
from foveal.engine.models.arch import ModelLoadError
from foveal.families.moondream import revisions
from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.weights import MoondreamWeights

TRAINING = {  # a few tensors of kestrel's layout (its weights.py), tiny
    "text_model.transformer.h.0.ln.weight": torch.ones(8),
    "text_model.transformer.h.0.mixer.Wqkv.weight": torch.zeros(24, 8),
    "text_model.transformer.h.0.tau_wq": torch.zeros(2, 24),
    "text_model.transformer.h.0.tau_alpha": torch.zeros(2),
    "text_model.transformer.h.1.gate.weight": torch.zeros(4, 8),
    "text_model.transformer.h.1.mlp.experts.weight": torch.zeros(4, 16, 8).to(torch.float8_e4m3fn),
    "region_model.ln.weight": torch.ones(8),
}


def real_names(config: dict | None = None, generation: int = 3) -> list[str]:
    return list(MoondreamWeights(MoondreamConfig.from_dict(config or {}, generation), device="meta").state_dict())


def test_the_preview_layout_and_the_region_layernorm(tmp_path):
    names = real_names()
    assert revisions.check3(tmp_path, names) == "preview"
    assert revisions.check3(tmp_path, [*names, "model.region.ln.weight", "model.region.ln.bias"]) == "region-ln"
    assert revisions.check3(tmp_path, real_names(generation=2)) is None  # Moondream 2: its own checks


def test_moondream_2s_2024_layout_is_not_taken_for_moondream_3(tmp_path):
    old = ["text_model.transformer.h.0.mixer.Wqkv.weight", "vision_encoder.encoder.model.visual.norm.weight"]
    assert revisions.check3(tmp_path, old) is None


def test_the_training_layout_is_refused_naming_what_it_holds(tmp_path):
    with pytest.raises(ModelLoadError, match=r"kestrel's\) training layout \(e\.g\. text_model\.transformer\.h\.0\.tau_alpha"):
        revisions.check3(tmp_path, list(TRAINING))


def folder_with(tmp_path, md3_dir, files: dict) -> object:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((md3_dir / name).read_bytes())
    for name, write in files.items():
        write(folder / name)
    return folder


def test_a_training_layout_folder_is_refused_at_load(tmp_path, md3_dir):
    folder = folder_with(tmp_path, md3_dir, {"model.safetensors": lambda p: save_file(TRAINING, p)})
    with pytest.raises(ModelLoadError) as refused:
        foveal.load(folder)
    message = str(refused.value)
    for said in ("text_model.transformer.h.0.tau_alpha", "experts stored as F8_E4M3", "with region_model.ln",
                 "moondream3.1-9B-A2B", "model_fp8.pt", "moondream/moondream3-preview's Hugging Face layout"):
        assert said in message, said


def test_the_fixture_is_the_preview_layout(md3_dir):
    from foveal.families.moondream.weights import stored_names

    assert revisions.check3(md3_dir, stored_names(md3_dir)) == "preview"
    assert json.loads((md3_dir / "config.json").read_text())["model_type"] == "moondream1"
