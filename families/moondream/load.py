"""Loading a Moondream 2 or 3 folder (`config.json` with model_type `moondream1` / architecture `HfMoondream`).

Nothing from the folder is executed: the architecture is foveal's own (this package), dims come
from config.json's `config` entry (empty in the real repository: the real defaults of the
generation), weights from `model.safetensors` (or its shards) by the real tensor names, the
tokenizer per tokenizer.py. The generation is read from the tensor names (weights.generation:
Moondream 3's tau and router tensors), since both generations' config.json say `moondream1`; the
region LayerNorm of later Moondream 3 checkpoints likewise (`model.region.ln`). Checks run before
the weights are read. Moondream 2 folders also pass revisions.py's check; Moondream 3 (preview)
has one implemented revision, so a folder's own refs are not read for it, but its layout is checked
(revisions.check3: Moondream's engine's training layout is refused by name).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.loader import LoadedModel

from . import revisions
from .config import MoondreamConfig
from .processor import MoondreamProcessor
from .quantize import check as quantize_check
from .quantize import quantize_text
from .runner import MoondreamRunner
from .tokenizer import load_tokenizer
from .weights import REGION_LN, MoondreamWeights, generation, load_weights, stored_names

# The runner's description: a vision model whose processor is MoondreamProcessor (processor.py).
MOONDREAM = Architecture("moondream", ("HfMoondream",), processor_class="MoondreamProcessor")


def is_moondream(raw: dict) -> bool:
    return raw.get("model_type") == "moondream1" or "HfMoondream" in (raw.get("architectures") or [])


def _readable_names(path: Path) -> list[str]:
    """The checkpoint's tensor names, or [] when its files cannot be read: the generation is then
    Moondream 2's, whose revision check runs first and whose weight loading names the problem."""
    try:
        return stored_names(path)
    except (ModelLoadError, OSError, SafetensorError):
        return []


def _checked(step: Callable[[], None]) -> None:
    """A quantize step whose ValueError (a shape or mode it refuses) is a load error."""
    try:
        step()
    except ValueError as error:
        raise ModelLoadError(str(error)) from None


def load_folder(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    source: str,
    image_cache_bytes: int,
    revision: str | None = None,
    quantize: str | None = None,
) -> tuple[LoadedModel, MoondreamConfig]:
    """`quantize`: None, "int8" or "int4" (quantize.py: its shapes checked on the meta-device model
    before any weight is read)."""
    raw = json.loads((path / "config.json").read_text())
    names = _readable_names(path)
    kind = generation(names)
    revisions.check3(path, names)  # a Moondream 3 layout foveal does not map is refused by what it holds
    if kind == 2:
        # before anything else: never the wrong revision's rules, nor another revision than the pinned one
        revisions.check(path, raw.get("config"), pinned=revision)
    config = MoondreamConfig.from_dict(raw.get("config"), kind, region_ln=REGION_LN in names)
    if quantize is not None:
        _checked(lambda: quantize_check(MoondreamWeights(config, device="meta").model.text, quantize))
    tokenizer = load_tokenizer(path, config.text.vocab_size, config.tokenizer.eos_id)
    weights = load_weights(path, config, device, dtype)
    if quantize is not None:
        _checked(lambda: quantize_text(weights.model.text, quantize))
    runner = MoondreamRunner(weights, MOONDREAM, image_cache_bytes)
    processor = MoondreamProcessor(config, tokenizer, device, dtype)
    return LoadedModel(runner, tokenizer, processor, (config.tokenizer.eos_id,), source), config
