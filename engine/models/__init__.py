"""Model runners and the loader: real checkpoint families on foveal's engine.

Design choice: build on transformers' model code, replace only attention.
    Each family's layers (RMSNorm variants, RoPE, Gemma's embedding scale, SigLIP/CLIP towers,
    PaliGemma's projector, Idefics3's pixel shuffle, LLaVA's feature selection) are transformers'
    own modules, so parity with the reference holds by construction, weight loading (safetensors
    and GGUF) is transformers', and a family costs one data entry (`families.py`). foveal writes
    only what is its own: paged attention registered through transformers' `AttentionInterface`
    (`attention.py`: K/V written at the engine's KV indices, read through its block tables, causal or
    PaliGemma prefix masks), the runner that turns a flat `ForwardBatch` into one model call
    (`runner.py`), decode replay of traced graphs on CPU (`traced.py`), the input processor and the
    loader: about 900 lines, docstrings included, for the first six architectures.
    Against compact own implementations: parity is 4e-6..1.2e-5 max logit difference in fp32 on
    every family (benchmarks/models.py), which own code would have to earn family by family; speed
    on CPU is the same matmuls either way. SmolLM2-135M, one torch thread, on this shared 2-core
    machine (two runs of benchmarks/models.py, load average 4-5): 10.7-12.5 tok/s at batch 1 and
    42-51 at batch 16 through the engine, transformers' `generate` 7.4-12.1 and 44-58 in the same
    runs. Tracing the decode step (`traced.py`) removes the eager modules' Python overhead:
    1.1-1.35x at batch 1, nothing measurable at batch 16 (compute-bound), and it works on
    transformers' modules unchanged.

The lean forward (issue 19): for launches without images, `lean.py` runs the text decoder itself
over the same modules and weights (Llama- and Gemma-style layers: every family here): one fused
`rms_norm` per norm, rotary by `roll`, attention called directly, whose decode path needs no padded
query block and no repeated K/V (the heads that share a KV head become its query rows), and a mask
built once per forward. Logits are identical to transformers' forward (fp32 parity unchanged).
Profiled here, batch 1, SmolLM2: after it the step is its matmuls (int4: 15.7 of 28.7 ms eager,
the int8 head 5 ms, the rest norms, attention and copies); traced replays add nothing measurable.

Small weights (issue 19): a llama GGUF loads quantized straight from the mapped file (`gguf.py`:
Q4_0/Q4_1 blocks -> int4 exactly, Q8_0 -> per-row int8; 2.2-2.5 s for SmolLM2 on this shared
machine, was 32.5 s), and `load(..., quantize="int8"|"int4")` quantizes a folder's decoder
(`quant.py`). torch's weight-only kernels run with bf16 activations (with fp32 ones they were
10-60x slower), so quantized models compute in bf16.

Families with code of their own:
    - Qwen2.5-VL and Qwen3-VL (`qwen_vl.py`, named by `Family.adapter`): transformers' modules, but
      their processors built without the video part (which needs torchvision) and M-RoPE positions
      (three streams) kept per KV row by the runner, so decode positions continue after an image
      without the engine knowing of them.
    - Moondream 2 (`moondream/`): transformers has no implementation that runs without the folder's
      remote code, so the architecture is foveal's own, on the same paged attention
      (`attention.paged_attention`), checked against the reference's recorded figures; its region
      heads are decoded inside the pipeline (engine/regions.py).

Image reuse: the runner keeps an LRU of image features by `PrefillInputs.image_key`, bounded in bytes
(`image_cache.py`, `load(..., image_cache_bytes=)`), so several calls on one image encode it once.

Test helpers (tiny random checkpoints of each family, the parity driver, the SmolLM2 GGUF download)
live in `foveal.testing`, not here.

Public names: `load`, `LoadedModel`, `HFRunner`, `ImageFeatureCache`, `PromptInputs`, `ModelLoadError`,
`supported_architectures`, `pages_for_budget`, `default_budget_bytes`.
"""

from foveal.engine.limits import default_budget_bytes, pages_for_budget
from foveal.engine.models.families import FAMILIES, ModelLoadError, supported_architectures
from foveal.engine.models.image_cache import DEFAULT_IMAGE_CACHE_BYTES, ImageFeatureCache
from foveal.engine.models.loader import LoadedModel, load
from foveal.engine.models.processor import InputProcessor, PromptInputs
from foveal.engine.models.runner import HFRunner

__all__ = [
    "DEFAULT_IMAGE_CACHE_BYTES",
    "FAMILIES",
    "HFRunner",
    "ImageFeatureCache",
    "InputProcessor",
    "LoadedModel",
    "ModelLoadError",
    "PromptInputs",
    "default_budget_bytes",
    "load",
    "pages_for_budget",
    "supported_architectures",
]
