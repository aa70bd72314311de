"""Loading a Moondream 2 folder (`config.json` with model_type `moondream1` / architecture `HfMoondream`).

Nothing from the folder is executed: the architecture is foveal's own (this package), dims come
from config.json's `config` entry (empty in the real repository: the real defaults), weights from
`model.safetensors` by the real tensor names, the tokenizer per tokenizer.py. Checks run before
the weights are read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.loader import LoadedModel

from . import revisions
from .config import MoondreamConfig
from .processor import MoondreamProcessor
from .runner import MoondreamRunner
from .tokenizer import load_tokenizer
from .weights import load_weights

# The runner's description: a vision model whose processor is MoondreamProcessor (processor.py).
MOONDREAM = Architecture("moondream", ("HfMoondream",), processor_class="MoondreamProcessor")


def is_moondream(raw: dict) -> bool:
    return raw.get("model_type") == "moondream1" or "HfMoondream" in (raw.get("architectures") or [])


def load_folder(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    source: str,
    image_cache_bytes: int,
    revision: str | None = None,
) -> tuple[LoadedModel, MoondreamConfig]:
    raw = json.loads((path / "config.json").read_text())
    # before anything else: never the wrong revision's rules, nor another revision than the pinned one
    revisions.check(path, raw.get("config"), pinned=revision)
    config = MoondreamConfig.from_dict(raw.get("config"))
    weights_file = path / "model.safetensors"
    if not weights_file.is_file():
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        raise ModelLoadError(f"{path} has no model.safetensors (found {shards}); Moondream 2 ships one file")
    tokenizer = load_tokenizer(path, config.text.vocab_size, config.tokenizer.eos_id)
    weights = load_weights(weights_file, config, device, dtype)
    runner = MoondreamRunner(weights, MOONDREAM, image_cache_bytes)
    processor = MoondreamProcessor(config, tokenizer, device, dtype)
    return LoadedModel(runner, tokenizer, processor, (config.tokenizer.eos_id,), source), config
