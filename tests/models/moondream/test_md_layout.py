"""Moondream 2's checkpoint layout and config (no files needed: the real model is built on the meta device)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from foveal.engine.models import ModelLoadError
from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.weights import MoondreamWeights, load_weights

TINY = {
    "text": {"dim": 128, "ff_dim": 256, "n_layers": 2, "vocab_size": 1024, "n_heads": 2, "n_kv_heads": 2},
    "vision": {
        "enc_dim": 32,
        "enc_ff_dim": 64,
        "enc_n_heads": 2,
        "proj_out_dim": 128,
        "proj_inner_dim": 128,
        "enc_n_layers": 1,
    },
    "region": {"dim": 128, "coord_feat_dim": 32, "size_feat_dim": 64, "inner_dim": 32},
}


def test_real_layout_on_meta_device():
    """An empty `config` entry is the real model: 592 tensors, 1,927,237,104 parameters, real names."""
    config = MoondreamConfig.from_dict({})
    state = MoondreamWeights(config, device="meta").state_dict()
    assert len(state) == 592
    assert sum(t.numel() for t in state.values()) == 1_927_237_104
    assert state["model.vision.patch_emb.weight"].shape == (1152, 588)
    assert state["model.vision.pos_emb"].shape == (1, 729, 1152)
    assert state["model.text.wte"].shape == (51200, 2048)
    assert state["model.text.blocks.23.attn.qkv.weight"].shape == (6144, 2048)
    assert state["model.text.lm_head.bias"].shape == (51200,)
    assert state["model.region.coord_features"].shape == (1, 128)
    assert state["model.region.size_features"].shape == (2, 256)
    assert state["model.region.size_decoder.fc2.weight"].shape == (2048, 8192)
    assert config.tokenizer.templates["caption"]["normal"] == [1, 32708, 2, 6382, 3]


def test_config_refuses_unknown_keys():
    with pytest.raises(ModelLoadError, match="unknown keys"):
        MoondreamConfig.from_dict({"text": {"dims": 3}})
    with pytest.raises(ModelLoadError, match="64-dim heads"):
        MoondreamConfig.from_dict({"text": {"dim": 100}})


def _tiny_file(tmp_path, edit=None):
    config = MoondreamConfig.from_dict(TINY)
    state = {
        k: torch.zeros(v.shape, dtype=torch.bfloat16)
        for k, v in MoondreamWeights(config, device="meta").state_dict().items()
    }
    if edit:
        state = edit(state)
    path = tmp_path / "model.safetensors"
    save_file(state, path)
    return path, config


def test_loads_bf16_as_requested_dtype(tmp_path):
    path, config = _tiny_file(tmp_path)
    model = load_weights(path, config, torch.device("cpu"), torch.float32)
    assert model.model.text.wte.dtype == torch.float32
    model = load_weights(path, config, torch.device("cpu"), torch.bfloat16)
    assert model.model.text.wte.dtype == torch.bfloat16


def test_missing_tensor_is_named(tmp_path):
    path, config = _tiny_file(
        tmp_path, lambda s: {k: v for k, v in s.items() if k != "model.text.post_ln.bias"}
    )
    with pytest.raises(ModelLoadError, match=r"model\.text\.post_ln\.bias"):
        load_weights(path, config, torch.device("cpu"), torch.float32)


def test_misshapen_tensor_is_named(tmp_path):
    def edit(state):
        state["model.region.coord_features"] = torch.zeros(16, 1, dtype=torch.bfloat16)
        return state

    path, config = _tiny_file(tmp_path, edit)
    with pytest.raises(ModelLoadError, match=r"model\.region\.coord_features has shape \[16, 1\]"):
        load_weights(path, config, torch.device("cpu"), torch.float32)


def test_older_layout_is_refused_naming_both_layouts(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(
        {
            "vision_encoder.encoder.model.visual.pos_embed": torch.zeros(1, 2),
            "text_model.transformer.embd.wte.weight": torch.zeros(2, 2),
        },
        path,
    )
    with pytest.raises(
        ModelLoadError, match=r"older vision_encoder\.\*.*foveal supports model\.\{vision,text,region\}"
    ):
        load_weights(path, MoondreamConfig.from_dict(TINY), torch.device("cpu"), torch.float32)


def test_config_json_format_roundtrip(tmp_path):
    """The fixture's config.json format: the dims live in the `config` entry; templates override the real ones."""
    entry = json.loads(
        json.dumps({**TINY, "tokenizer": {"templates": {"query": {"prefix": [1, 21, 2], "suffix": [3]}}}})
    )
    config = MoondreamConfig.from_dict(entry)
    assert config.tokenizer.templates["query"]["prefix"] == [1, 21, 2]
    assert config.tokenizer.templates["detect"]["prefix"] == [1, 7235, 476, 2]  # the rest stay real
    assert config.vision.enc_n_layers == 1


def _finetuned(state):
    """As the reference's fine-tuning scripts save it: no wrapper prefix, each block's KV-cache buffers."""
    out = {k.removeprefix("model."): v for k, v in state.items()}
    for i in range(TINY["text"]["n_layers"]):
        for which in ("k_cache", "v_cache"):
            out[f"text.blocks.{i}.kv_cache.{which}"] = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    return out


def test_finetuned_checkpoint_loads(tmp_path):
    """Prefix-less names take the wrapper's prefix; the KV-cache buffers are skipped; values are kept."""

    def edit(state):
        state = {k: torch.randn(v.shape).to(torch.bfloat16) for k, v in state.items()}
        edit.original = state
        return _finetuned(state)

    path, config = _tiny_file(tmp_path, edit)
    model = load_weights(path, config, torch.device("cpu"), torch.float32)
    loaded = model.state_dict()
    assert set(loaded) == set(edit.original)
    assert all(torch.equal(loaded[k], v.float()) for k, v in edit.original.items())


def test_finetuned_checkpoint_still_refuses_by_name(tmp_path):
    def extra(state):
        return {**_finetuned(state), "text.blocks.0.lora_scale": torch.zeros(1, dtype=torch.bfloat16)}

    path, config = _tiny_file(tmp_path, extra)
    with pytest.raises(ModelLoadError, match=r"text\.blocks\.0\.lora_scale"):
        load_weights(path, config, torch.device("cpu"), torch.float32)

    def missing(state):
        return {k: v for k, v in _finetuned(state).items() if k != "region.coord_features"}

    path, config = _tiny_file(tmp_path, missing)
    with pytest.raises(ModelLoadError, match=r"region\.coord_features"):
        load_weights(path, config, torch.device("cpu"), torch.float32)

    def misshapen(state):
        return {**_finetuned(state), "text.post_ln.bias": torch.zeros(3, dtype=torch.bfloat16)}

    path, config = _tiny_file(tmp_path, misshapen)
    with pytest.raises(ModelLoadError, match=r"text\.post_ln\.bias has shape \[3\]"):
        load_weights(path, config, torch.device("cpu"), torch.float32)
