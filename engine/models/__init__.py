"""The engine's model building blocks: a generic runner over transformers' modules and what it stands on.

Design choice: build on transformers' model code, replace only attention. A model's layers (RMSNorm
variants, RoPE, Gemma's embedding scale, SigLIP/CLIP towers, projectors, pixel shuffles) are
transformers' own modules, so parity with the reference holds by construction and weight loading
(safetensors, and GGUF off CPU) is transformers'. The one exception is a llama GGUF file on CPU,
which foveal reads into its own module tree (gguf.py; the text decoder runs lean.py's forward,
whose parity with transformers' is tested). foveal writes only what is its own:
    attention.py    paged attention registered through transformers' `AttentionInterface`: K/V written
                    at the engine's KV indices, read through its block tables, causal or prefix masks
    runner.py       `HFRunner`: one flat `ForwardBatch` -> one model call
    lean.py         the text decoder run directly over the same modules for launches without images
                    (fused norms, no padded query block, GQA heads folded into query rows)
    traced.py       decode steps replayed as traced graphs on CPU (one native call that keeps the GIL
                    released, the CPU twin of CUDA-graph replay)
    quant.py        weight-only int8 / int4 and fp16 linears for CPU
    gguf.py         llama .gguf files read straight from the mapped file, into foveal's own module tree in
                    transformers' llama names (run by lean.py; no transformers modeling code imported)
    weight_cache.py a GGUF file's prepared weights and tokenizer kept on disk for the next load
    image_cache.py  an LRU of image features by image key, bounded in bytes
    processor.py    `InputProcessor`: text + images -> prompt ids + `PrefillInputs`, through the
                    model's own transformers processor
    arch.py         `Architecture`: what the runner and processor need to know of a model class
    loader.py       options, sources, folder checks, loading and assembling (`LoadedModel`)
Which checkpoints these serve, and how, is the business of `foveal.families`; nothing here names a family.
"""

from foveal.engine.limits import default_budget_bytes, pages_for_budget
from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.image_cache import DEFAULT_IMAGE_CACHE_BYTES, ImageFeatureCache
from foveal.engine.models.loader import LoadedModel, LoadOptions, resolve_options
from foveal.engine.models.processor import InputProcessor, PromptInputs
from foveal.engine.models.runner import HFRunner

__all__ = [
    "DEFAULT_IMAGE_CACHE_BYTES",
    "Architecture",
    "HFRunner",
    "ImageFeatureCache",
    "InputProcessor",
    "LoadOptions",
    "LoadedModel",
    "ModelLoadError",
    "PromptInputs",
    "default_budget_bytes",
    "pages_for_budget",
    "resolve_options",
]
