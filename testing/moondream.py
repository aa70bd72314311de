"""A tiny random Moondream 2 checkpoint folder in the real format (for tests that must not need ../shared).

`build(folder)` writes config.json (the real repo's format: tiny dims in its `config` entry, the real
special ids and prompt templates), model.safetensors (random bf16 weights under the real tensor names)
and the SmolLM2 tokenizer shipped in foveal.testing as the folder's tokenizer.json: a byte-level BPE
vocabulary (49,152 tokens, so the real template ids fit) whose id 0 is the special `<|endoftext|>`,
as in Moondream's own, so the loader takes it as the model's vocabulary. Weights are drawn like the
fixture's in ../shared/fixtures/moondream2-tiny (N(0, 1/fan_in) linears, N(0, 0.5^2) embeddings).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.weights import MoondreamWeights
from foveal.testing import SMOLLM2_TOKENIZER

VOCAB = 49152
CONFIG = {
    "text": {"dim": 128, "ff_dim": 256, "n_layers": 2, "vocab_size": VOCAB, "n_heads": 2, "n_kv_heads": 2},
    "vision": {
        "enc_dim": 32,
        "enc_n_layers": 27,
        "enc_ff_dim": 64,
        "enc_n_heads": 2,
        "proj_out_dim": 128,
        "proj_inner_dim": 128,
    },
    "region": {"dim": 128, "coord_feat_dim": 32, "size_feat_dim": 64, "inner_dim": 32},
}


def build(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    raw = {
        "architectures": ["HfMoondream"],
        "auto_map": {
            "AutoConfig": "hf_moondream.HfConfig",
            "AutoModelForCausalLM": "hf_moondream.HfMoondream",
        },
        "config": CONFIG,
        "model_type": "moondream1",
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(raw, indent=1))
    config = MoondreamConfig.from_dict(CONFIG)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, meta in MoondreamWeights(config, device="meta").state_dict().items():
        state[name] = _draw(name, tuple(meta.shape), generator).to(torch.bfloat16)
    save_file(state, folder / "model.safetensors")
    shutil.copy(SMOLLM2_TOKENIZER / "tokenizer.json", folder / "tokenizer.json")
    return folder


def _draw(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    if name.endswith(("wte", "pos_emb")):
        return normal(0.5)
    if name.endswith("features"):
        return normal(1.0)
    if ".ln" in name or "post_ln" in name:
        return 1 + normal(0.1) if name.endswith("weight") else normal(0.05)
    if name.endswith("bias"):
        return normal(0.02)
    return normal(shape[-1] ** -0.5)
