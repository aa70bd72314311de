"""`MoondreamConfig`: the dimensions, special ids and prompt templates of a Moondream 2 or 3 checkpoint.

PROBLEM
    The real `vikhyatk/moondream2` and `moondream/moondream3-preview` folders' `config.json` are
    remote-code configs whose nested `config` entry is empty: the reference resets it to `{}` on
    load, so the real model always runs with the dimensions built into the reference's config
    dataclasses, which differ between the two generations (Moondream 3: a mixture of experts from
    layer 4, a 4096-token context, one-Linear region decoders). A test fixture (or another revision)
    fills that entry to override some of them. Both generations' folders say `moondream1`; only
    their tensors tell them apart (load.py reads the generation from the file's keys).
SOLUTION
    Frozen dataclasses with the real defaults of the generation (Moondream 2, 2025 "starmie"
    revision: text 2048 x 24 layers, vision 1152 x 27 layers, region heads of 8192; Moondream 3
    preview: the same vision, text 2048 x 24 layers with 64 experts top-8 from layer 4, region
    decoders without a hidden layer), built from the `config` entry of `config.json`: a missing or
    empty entry means the real model, a filled one overrides field by field. Unknown keys are
    refused by name, so a revision with other fields fails at load, not mid-forward.
    Moondream 3's tau attention computes its token features with the exact GELU (the preview code);
    `text.tau_gelu: "tanh"` selects the tanh approximation, which Moondream's own engine (kestrel)
    has used since its "Fix Moondream tau GELU semantics" change.
INVARIANTS
    - `head_dim` is 64 and the rotary part covers its first 32 dims (the reference asserts both).
    - The vision grid is crop_size / patch_size = 27 patches a side (729 image tokens).
    - A Moondream 2 config has no `moe`; a Moondream 3 config always has one (its dense layers
      are those below `moe.start_layer`) and n_kv_heads == n_heads (tau scales v per query head).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from foveal.engine.models.arch import ModelLoadError

HEAD_DIM = 64
ROTARY_DIM = 32
ROPE_THETA = 10000.0
ROPE_THETA_3 = 1_500_000.0  # Moondream 3's rotary base
TAU_GELUS = ("exact", "tanh")
CROP_SIZE = 378  # fixed in the reference's crop code, whatever the config says
PATCH_SIZE = 14
LN_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Moondream 3's mixture of experts: layers from `start_layer` on route each token to
    `experts_per_token` of `num_experts` GeGLU experts of inner dim `expert_inner_dim`."""

    num_experts: int = 64
    start_layer: int = 4
    experts_per_token: int = 8
    expert_inner_dim: int = 1024


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
    moe: MoeConfig | None = None  # Moondream 3 only
    tau_gelu: str = "exact"  # Moondream 3's tau token features: "exact" (the preview code) or "tanh"


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
    inner_dim: int | None = 8192  # the decoders' hidden layer (Moondream 2); None: one Linear (Moondream 3)
    group_size: int | None = None
    ln: bool = False  # a LayerNorm before the decoders (later Moondream 3 checkpoints' model.region.ln)


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
    generation: int = 2  # 2: Moondream 2; 3: Moondream 3 (preview)

    @property
    def rope_theta(self) -> float:
        return ROPE_THETA_3 if self.generation == 3 else ROPE_THETA

    @property
    def image_tokens(self) -> int:
        side = CROP_SIZE // PATCH_SIZE
        return side * side

    @property
    def prefix_len(self) -> int:
        """BOS + the image's rows: the bidirectional prefix of a prompt with an image."""
        return 1 + self.image_tokens

    @classmethod
    def from_dict(
        cls, entry: dict[str, Any] | None, generation: int = 2, region_ln: bool = False
    ) -> MoondreamConfig:
        """From the `config` entry of config.json; None or {} is the real model of `generation`.
        `region_ln`: the checkpoint has the region LayerNorm (a tensor, never a config key)."""
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
        values = {name: dict(entry.get(name) or {}) for name in parts}
        if generation == 3:
            values = _moondream3_defaults(values)
        values["region"]["ln"] = region_ln
        built = {name: _build(kind, values[name], name) for name, kind in parts.items()}
        config = cls(**built, generation=generation)
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
        self._check_generation()
        if self.text.group_size is not None or self.region.group_size is not None:
            raise ModelLoadError(
                "int4 quantized Moondream checkpoints (group_size set) are not supported; use the bf16 one"
            )


    def _check_generation(self) -> None:
        t = self.text
        if self.generation == 2:
            if t.moe is not None or t.tau_gelu != "exact":
                raise ModelLoadError(
                    "config.json's text entry has Moondream 3 keys (moe / tau_gelu) but the weights are "
                    "Moondream 2's (no tau, no router tensors)"
                )
            return
        if t.moe is None or t.n_kv_heads != t.n_heads:
            raise ModelLoadError(
                f"Moondream 3 needs text.moe and n_kv_heads == n_heads (got moe={t.moe}, "
                f"n_kv_heads {t.n_kv_heads}, n_heads {t.n_heads})"
            )
        if t.tau_gelu not in TAU_GELUS:
            raise ModelLoadError(f"config.text.tau_gelu is {t.tau_gelu!r}; use one of {', '.join(TAU_GELUS)}")
        if not 0 <= t.moe.start_layer <= t.n_layers or t.moe.experts_per_token > t.moe.num_experts:
            raise ModelLoadError(f"config.text.moe {t.moe} does not fit {t.n_layers} text layers")
        if self.region.inner_dim is not None:
            raise ModelLoadError("Moondream 3's region decoders are one Linear each: config.region.inner_dim must be unset")


def _moondream3_defaults(values: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The preview's built-in defaults where Moondream 3 differs from Moondream 2, under the entry's own."""
    text = {"max_context": 4096, **values["text"]}
    text["moe"] = MoeConfig(**text["moe"]) if isinstance(text.get("moe"), dict) else text.get("moe") or MoeConfig()
    region = {"inner_dim": None, **values["region"]}
    return {**values, "text": text, "region": region}


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
