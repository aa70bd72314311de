"""Moondream's weights: the module tree under the real checkpoint's tensor names, and loading them.

PROBLEM
    The real `model.safetensors` (2025 revisions) holds 592 bf16 tensors under names written by the
    HF wrapper class (`model.vision.*`, `model.text.*`, `model.region.*`). Older revisions used other
    names (`vision_encoder.*`, `text_model.*`, `region_model.*`, Fourier matrices transposed). A
    loader that maps names loosely loads a wrong or partial model silently.
SOLUTION
    `MoondreamWeights` is an nn.Module whose `state_dict()` keys are exactly the real names (so the
    layout is checked by construction, and a meta-device build counts the real parameters).
    `load_weights` reads the file's header first: a file of another layout is refused naming the
    layout found and the one supported; a missing, unexpected or misshapen tensor is refused by
    name; then tensors are read and cast to the requested dtype (bf16 stays bf16, or is upcast).
    A checkpoint saved by the reference's fine-tuning scripts (`MoondreamModel.state_dict()`: the same
    names without the wrapper's `model.` prefix, plus each text block's KV-cache buffers
    `text.blocks.{i}.kv_cache.{k,v}_cache`) loads: the prefix is added and the buffers are skipped.
INVARIANTS
    - Every parameter is assigned from the file exactly once; nothing stays uninitialized.
    - No buffers are stored in the file (rotary tables and masks are computed).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from foveal.engine.models.arch import ModelLoadError

from .config import MoondreamConfig
from .region import RegionHeads
from .text import TextDecoder
from .vision import VisionEncoder

SUPPORTED_LAYOUT = (
    "model.{vision,text,region}.* (vikhyatk/moondream2 2025 revisions), or the same without 'model.' "
    "(the reference's fine-tuning scripts)"
)
OLD_LAYOUT_PREFIXES = ("vision_encoder.", "text_model.", "region_model.")
UNWRAPPED_PREFIXES = ("vision.", "text.", "region.")
KV_BUFFER = re.compile(r"(model\.)?text\.blocks\.\d+\.kv_cache\.[kv]_cache")  # the reference's cache buffers


class _Parts(nn.Module):
    def __init__(self, config: MoondreamConfig, **factory) -> None:
        super().__init__()
        self.vision = VisionEncoder(config.vision, **factory)
        self.text = TextDecoder(config.text, **factory)
        self.region = RegionHeads(config.region, **factory)


class MoondreamWeights(nn.Module):
    """The whole model's parameters; `self.model` mirrors the HF wrapper's attribute of that name."""

    def __init__(
        self, config: MoondreamConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = config
        self.model = _Parts(config, device=device, dtype=dtype)


def describe_layout(names: list[str]) -> str:
    """A one-phrase description of a checkpoint's key layout (for error messages)."""
    if any(n.startswith(OLD_LAYOUT_PREFIXES) for n in names):
        return "the older vision_encoder.* / text_model.* / region_model.* layout (2024 revisions)"
    sample = ", ".join(sorted(names)[:3])
    return f"an unknown layout (first keys: {sample})"


def _wrapped(name: str) -> str:
    """A fine-tuning script's name (no wrapper prefix) as the checkpoint's."""
    return "model." + name if name.startswith(UNWRAPPED_PREFIXES) else name


def load_weights(
    path: Path, config: MoondreamConfig, device: torch.device, dtype: torch.dtype
) -> MoondreamWeights:
    """Build the model on `device` in `dtype` and fill it from `path` (one safetensors file)."""
    expected = MoondreamWeights(config, device="meta")
    shapes = {name: tuple(p.shape) for name, p in expected.state_dict().items()}
    with safe_open(str(path), framework="pt") as file:
        stored = {_wrapped(n): n for n in file.keys() if not KV_BUFFER.fullmatch(n)}  # noqa: SIM118
        names = list(stored)
        if not any(n.startswith("model.vision.") for n in names):
            raise ModelLoadError(
                f"{path} holds Moondream weights in {describe_layout(names)}; foveal supports {SUPPORTED_LAYOUT}. "
                "Download the current vikhyatk/moondream2 revision."
            )
        missing = sorted(set(shapes) - set(names))
        if missing:
            raise ModelLoadError(
                f"{path} lacks {len(missing)} tensor(s) of the Moondream 2 layout, e.g. {missing[:3]}; "
                "the file is incomplete or of another revision (check config.json's 'config' entry, e.g. text.n_layers)"
            )
        extra = sorted(stored[n] for n in set(names) - set(shapes))
        if extra:
            raise ModelLoadError(
                f"{path} has {len(extra)} tensor(s) this Moondream 2 config does not use, e.g. {extra[:3]}; "
                "check config.json's 'config' entry (layer counts) against the file"
            )
        for name in names:
            got = tuple(file.get_slice(stored[name]).get_shape())
            if got != shapes[name]:
                raise ModelLoadError(
                    f"{path}: tensor {name} has shape {list(got)} but this config needs {list(shapes[name])}; "
                    "check config.json's 'config' entry (dims) against the file"
                )
        state = {name: file.get_tensor(stored[name]).to(device=device, dtype=dtype) for name in names}
    model = MoondreamWeights(config, device="meta", dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
