"""Moondream's weights (2 and 3): the module tree under the real checkpoint's tensor names, and loading them.

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
    Moondream 3 (preview) has the same three parts under the same prefixes; its text blocks hold
    `attn.tau.*` and, from `moe.start_layer` on, `mlp.router` and expert stacks, its region decoders
    are one Linear each (text3.py, moe.py, region.py). `generation(names)` tells the two apart by
    those tensors (both folders' config.json say `moondream1`); a file with neither generation's
    text blocks is refused naming what it lacks. Its weights may be one file or shards
    (`model.safetensors.index.json`).
INVARIANTS
    - Every parameter is assigned from the file exactly once; nothing stays uninitialized.
    - No buffers are stored in the file (rotary tables and masks are computed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from foveal.engine.models.arch import ModelLoadError

from .config import MoondreamConfig
from .region import RegionHeads
from .text import TextDecoder
from .text3 import TextDecoder3
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
        self.text = (TextDecoder3 if config.generation == 3 else TextDecoder)(config.text, **factory)
        self.region = RegionHeads(config.region, **factory)


class MoondreamWeights(nn.Module):
    """The whole model's parameters; `self.model` mirrors the HF wrapper's attribute of that name."""

    def __init__(
        self, config: MoondreamConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = config
        self.model = _Parts(config, device=device, dtype=dtype)


MD3_MARKS = (".attn.tau.", ".mlp.router.")  # tensors only Moondream 3's text blocks have
REGION_LN = "model.region.ln.weight"


def generation(names: list[str]) -> int:
    """3 when the file holds Moondream 3's tau or router tensors, else 2 (its own checks then name
    what a Moondream 2 file lacks)."""
    return 3 if any(mark in name for name in names for mark in MD3_MARKS) else 2


def tensor_files(folder: Path) -> dict[str, Path]:
    """Each stored tensor's name (as written) -> its file: model.safetensors, or the shards of
    model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        absent = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if absent:
            raise ModelLoadError(f"{index} names shards that are absent: {absent[:3]}")
        return {name: folder / f for name, f in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
        raise ModelLoadError(
            f"{folder} has no model.safetensors nor model.safetensors.index.json (found {shards})"
        )
    return _single(single)


def stored_names(folder: Path) -> list[str]:
    """The checkpoint's tensor names as load_weights reads them (wrapper prefix added, cache buffers dropped)."""
    return [_wrapped(n) for n in tensor_files(folder) if not KV_BUFFER.fullmatch(n)]


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
    """Build the model on `device` in `dtype` and fill it from `path`: a safetensors file, or a
    checkpoint folder (one file or shards)."""
    files = tensor_files(path) if path.is_dir() else _single(path)
    expected = MoondreamWeights(config, device="meta")
    shapes = {name: tuple(p.shape) for name, p in expected.state_dict().items()}
    stored = {_wrapped(n): n for n in files if not KV_BUFFER.fullmatch(n)}
    names = list(stored)
    model_name = f"Moondream {config.generation}"
    if not any(n.startswith("model.vision.") for n in names):
        raise ModelLoadError(
            f"{path} holds Moondream weights in {describe_layout(names)}; foveal supports {SUPPORTED_LAYOUT}. "
            "Download the current vikhyatk/moondream2 revision or moondream/moondream3-preview."
        )
    missing = sorted(set(shapes) - set(names))
    if missing:
        raise ModelLoadError(
            f"{path} lacks {len(missing)} tensor(s) of the {model_name} layout, e.g. {missing[:3]}; "
            "the file is incomplete or of another revision (check config.json's 'config' entry, e.g. text.n_layers)"
        )
    extra = sorted(stored[n] for n in set(names) - set(shapes))
    if extra:
        raise ModelLoadError(
            f"{path} has {len(extra)} tensor(s) this {model_name} config does not use, e.g. {extra[:3]}; "
            "check config.json's 'config' entry (layer counts) against the file"
        )
    state = {}
    for file_path, group in _by_file(files, stored).items():
        with safe_open(str(file_path), framework="pt") as file:
            for name in group:
                got = tuple(file.get_slice(stored[name]).get_shape())
                if got != shapes[name]:
                    raise ModelLoadError(
                        f"{path}: tensor {name} has shape {list(got)} but this {model_name} config needs "
                        f"{list(shapes[name])}; check config.json's 'config' entry (dims) against the file"
                    )
                state[name] = file.get_tensor(stored[name]).to(device=device, dtype=dtype)
    model = MoondreamWeights(config, device="meta", dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _single(path: Path) -> dict[str, Path]:
    with safe_open(str(path), framework="pt") as file:
        return dict.fromkeys(file.keys(), path)  # noqa: SIM118


def _by_file(files: dict[str, Path], stored: dict[str, str]) -> dict[Path, list[str]]:
    """The checkpoint's names grouped by the file that holds them (each file opened once)."""
    groups: dict[Path, list[str]] = {}
    for name, raw in stored.items():
        groups.setdefault(files[raw], []).append(name)
    return groups
