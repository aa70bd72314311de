"""Moondream 3's module tree is the real checkpoint's layout (built on the meta device: names, shapes,
counts as the fixture README states them), its generation is read from the tensors, and the region
LayerNorm of later checkpoints (`model.region.ln`) is loaded and applied where a file has it."""

from __future__ import annotations

import pytest
import torch

import foveal
from foveal.engine.models.arch import ModelLoadError
from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.weights import MoondreamWeights, generation

REAL_TENSORS, REAL_PARAMETERS = 660, 9_268_622_832  # moondream/moondream3-preview, from the fixture README


def test_the_real_layout():
    state = MoondreamWeights(MoondreamConfig.from_dict({}, 3), device="meta").state_dict()
    assert len(state) == REAL_TENSORS
    assert sum(t.numel() for t in state.values()) == REAL_PARAMETERS
    shapes = {
        "model.text.blocks.0.attn.qkv.weight": (6144, 2048),
        "model.text.blocks.0.attn.tau.wq": (32, 6144),
        "model.text.blocks.0.attn.tau.alpha": (32,),
        "model.text.blocks.3.mlp.fc1.weight": (8192, 2048),
        "model.text.blocks.4.mlp.router.bias": (64,),
        "model.text.blocks.4.mlp.fc1.weight": (64, 2048, 2048),
        "model.text.blocks.23.mlp.fc2.weight": (64, 2048, 1024),
        "model.text.lm_head.bias": (51200,),
        "model.region.coord_features": (1, 128),
        "model.region.coord_decoder.weight": (1024, 2048),
        "model.region.size_decoder.weight": (2048, 2048),
        "model.vision.proj_mlp.fc1.weight": (8192, 2304),
    }
    assert {name: tuple(state[name].shape) for name in shapes} == shapes
    assert "model.text.blocks.4.mlp.fc1.bias" not in state  # experts have no biases


def test_defaults_and_checks():
    config = MoondreamConfig.from_dict({}, 3)
    assert config.text.max_context == 4096 and config.text.moe is not None and config.rope_theta == 1.5e6
    assert config.region.inner_dim is None and config.text.tau_gelu == "exact"
    with pytest.raises(ModelLoadError, match="tau_gelu"):
        MoondreamConfig.from_dict({"text": {"tau_gelu": "fast"}}, 3)
    with pytest.raises(ModelLoadError, match="Moondream 3 keys"):
        MoondreamConfig.from_dict({"text": {"tau_gelu": "tanh"}}, 2)


def test_generation_from_the_tensors():
    assert generation(["model.text.blocks.0.attn.tau.wq", "model.vision.patch_emb.weight"]) == 3
    assert generation(["model.text.blocks.2.mlp.router.weight"]) == 3
    assert generation(["model.text.blocks.0.attn.qkv.weight", "model.text.blocks.0.mlp.fc1.weight"]) == 2


def test_the_region_layernorm_is_loaded_and_applied(md3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((md3_dir / name).read_bytes())
    state = load_file(md3_dir / "model.safetensors")
    torch.manual_seed(1)
    state["model.region.ln.weight"] = (1 + 0.1 * torch.randn(128)).to(torch.bfloat16)
    state["model.region.ln.bias"] = (0.05 * torch.randn(128)).to(torch.bfloat16)
    save_file(state, tmp_path / "model.safetensors")
    with foveal.load(tmp_path) as model:
        region = model.family.runner.region
        assert model.family.config.region.ln and region.ln is not None
        h = torch.randn(3, 128)
        with torch.inference_mode():
            torch.testing.assert_close(region.coord_logits(h), region.coord_decoder(region.ln(h)))
            assert not torch.allclose(region.coord_logits(h), region.coord_decoder(h))
        points = model.point(md3_dir / "images" / "shapes_320x240.png", "tok1011 tok77")["points"]
        assert all(0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 for p in points)
