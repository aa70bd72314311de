"""`MoondreamConfig`: the dimensions, special ids and prompt templates of a Moondream 2 checkpoint.

PROBLEM
    The real `vikhyatk/moondream2` folder's `config.json` is a remote-code config whose nested
    `config` entry is empty: the reference resets it to `{}` on load, so the real model always runs
    with the dimensions built into the reference's config dataclasses. A test fixture (or another
    revision) fills that entry to override some of them.
SOLUTION
    Frozen dataclasses with the real defaults (2025 "starmie" revision: text 2048 x 24 layers,
    vision 1152 x 27 layers, region heads of 8192), built from the `config` entry of `config.json`:
    a missing or empty entry means the real model, a filled one overrides field by field. Unknown
    keys are refused by name, so a revision with other fields fails at load, not mid-forward.
INVARIANTS
    - `head_dim` is 64 and the rotary part covers its first 32 dims (the reference asserts both).
    - The vision grid is crop_size / patch_size = 27 patches a side (729 image tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from foveal.engine.models.arch import ModelLoadError

HEAD_DIM = 64
ROTARY_DIM = 32
ROPE_THETA = 10000.0
CROP_SIZE = 378  # fixed in the reference's crop code, whatever the config says
PATCH_SIZE = 14
LN_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32
    prefix_attn: int = 730
    group_size: int | None = None


@dataclass(frozen=True, slots=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4
    proj_inner_dim: int = 8192


@dataclass(frozen=True, slots=True)
class RegionConfig:
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    inner_dim: int = 8192
    group_size: int | None = None


def _real_templates() -> dict[str, dict[str, list[int]]]:
    return {
        "caption": {
            "short": [1, 32708, 2, 12492, 3],
            "normal": [1, 32708, 2, 6382, 3],
            "long": [1, 32708, 2, 4059, 3],
        },
        "query": {"prefix": [1, 15381, 2], "suffix": [3]},
        "detect": {"prefix": [1, 7235, 476, 2], "suffix": [3]},
        "point": {"prefix": [1, 2581, 2], "suffix": [3]},
    }


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    thinking_id: int = 4
    coord_id: int = 5
    size_id: int = 6
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    templates: dict[str, dict[str, list[int]]] = field(default_factory=_real_templates)


@dataclass(frozen=True, slots=True)
class MoondreamConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    @property
    def image_tokens(self) -> int:
        side = CROP_SIZE // PATCH_SIZE
        return side * side

    @property
    def prefix_len(self) -> int:
        """BOS + the image's rows: the bidirectional prefix of a prompt with an image."""
        return 1 + self.image_tokens

    @classmethod
    def from_dict(cls, entry: dict[str, Any] | None) -> MoondreamConfig:
        """From the `config` entry of config.json; None or {} is the real model."""
        entry = dict(entry or {})
        parts = {
            "text": TextConfig,
            "vision": VisionConfig,
            "region": RegionConfig,
            "tokenizer": TokenizerConfig,
        }
        unknown = sorted(set(entry) - set(parts))
        if unknown:
            raise ModelLoadError(
                f"config.json's 'config' entry has unknown sections {unknown}; known: {sorted(parts)}"
            )
        built = {name: _build(kind, entry.get(name) or {}, name) for name, kind in parts.items()}
        config = cls(**built)
        config.check()
        return config

    def check(self) -> None:
        t, v = self.text, self.vision
        if t.dim != t.n_heads * HEAD_DIM:
            raise ModelLoadError(
                f"text dim {t.dim} is not n_heads {t.n_heads} x {HEAD_DIM}: Moondream's rotary needs 64-dim heads"
            )
        if t.n_heads % t.n_kv_heads:
            raise ModelLoadError(f"text n_heads {t.n_heads} is not a multiple of n_kv_heads {t.n_kv_heads}")
        if v.enc_dim % v.enc_n_heads:
            raise ModelLoadError(
                f"vision enc_dim {v.enc_dim} is not a multiple of enc_n_heads {v.enc_n_heads}"
            )
        if v.enc_patch_size != PATCH_SIZE or v.crop_size != CROP_SIZE:
            raise ModelLoadError(
                f"vision crop {v.crop_size} / patch {v.enc_patch_size}: the reference's crops are fixed at "
                f"{CROP_SIZE} / {PATCH_SIZE}; a checkpoint with others is not Moondream 2"
            )
        if self.text.group_size is not None or self.region.group_size is not None:
            raise ModelLoadError(
                "int4 quantized Moondream checkpoints (group_size set) are not supported; use the bf16 one"
            )


def _build(kind: type, values: dict[str, Any], section: str) -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ModelLoadError(
            f"config.json: config.{section} has unknown keys {unknown}; known: {sorted(names)}"
        )
    if section == "tokenizer" and "templates" in values:
        templates = _real_templates()
        for skill, entry in (values["templates"] or {}).items():
            templates[skill] = entry
        values = {**values, "templates": templates}
    return kind(**values)
