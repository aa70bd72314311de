"""Model runners and the loader: real checkpoint families on foveal's engine.

Design choice: build on transformers' model code, replace only attention.
    Each family's layers (RMSNorm variants, RoPE, Gemma's embedding scale, SigLIP/CLIP towers,
    PaliGemma's projector, Idefics3's pixel shuffle, LLaVA's feature selection) are transformers'
    own modules, so parity with the reference is by construction, weight loading (safetensors and
    GGUF) is transformers', and a family costs one data entry (`families.py`). foveal writes only
    what is its own: paged attention registered through transformers' `AttentionInterface`
    (`attention.py`: K/V written at the engine's slots, read through its block tables, causal or
    prefix masks), the runner that turns a flat `ForwardBatch` into one call (`runner.py`), the
    input processor, and the loader. Measured against writing compact own implementations:
    logits match transformers to ~1e-6 in fp32 (tests/models), the whole package is a few hundred
    lines for five families, and speed is that of the same eager modules (see
    benchmarks/models.py for tokens/s next to transformers' `generate`).

Public names: `load`, `LoadedModel`, `HFRunner`, `PromptInputs`, `ModelLoadError`,
`supported_architectures`, `pages_for_budget`, `default_budget_bytes`, `smollm2_gguf`, `smollm2_folder`.
"""

from foveal.engine.models.budget import default_budget_bytes, pages_for_budget
from foveal.engine.models.families import FAMILIES, ModelLoadError, supported_architectures
from foveal.engine.models.gguf import smollm2_folder, smollm2_gguf
from foveal.engine.models.loader import LoadedModel, load
from foveal.engine.models.processor import InputProcessor, PromptInputs
from foveal.engine.models.runner import HFRunner

__all__ = [
    "FAMILIES",
    "HFRunner",
    "InputProcessor",
    "LoadedModel",
    "ModelLoadError",
    "PromptInputs",
    "default_budget_bytes",
    "load",
    "pages_for_budget",
    "smollm2_folder",
    "smollm2_gguf",
    "supported_architectures",
]
