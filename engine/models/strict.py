"""Loading a transformers model that must find every one of its tensors in the folder.

PROBLEM
    transformers' `from_pretrained` fills a tensor the checkpoint lacks with random values and only
    logs a warning, so a folder cut short (a shard missing, a tensor renamed) loads and answers
    nonsense. The generic loader (`loader.load_transformers`) also refuses attention variants the
    paged attention did not implement (sliding windows, soft-capping) for every family alike.
SOLUTION
    `load_strict` is `load_transformers` for families whose runner implements their attention
    variants (they check their own config first): the same processor, quantization and device
    steps, with the model's loading report read back and a checkpoint that misses or mis-shapes a
    tensor refused, naming the tensors. `config` lets a family load the model under an edited
    config (Gemma 4 without its audio tower).
INVARIANTS
    - A folder missing any tensor the model expects (tied weights excepted: transformers ties them)
      or holding one of another shape raises ModelLoadError naming it; nothing is returned then.
    - Nothing from the folder is executed (no trust_remote_code) and only safetensors are read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.attention import hf_attention
from foveal.engine.models.loader import LoadOptions, check_vision_files
from foveal.engine.models.quant import quantize_model

SHOWN = 5  # tensors named in a refusal


def load_strict(
    path: Path,
    arch: Architecture,
    class_name: str,
    options: LoadOptions,
    processor: Callable[[], tuple[Any, Any]],
    config: Any = None,
) -> tuple[Any, Any, Any]:
    """(model on the device, hf processor, tokenizer) of a folder whose model is transformers' `class_name`,
    its decoder on foveal's paged attention; ModelLoadError when the folder lacks a tensor."""
    if arch.has_vision:
        check_vision_files(path)
    hf_processor, tokenizer = processor()
    name = hf_attention()
    attn = {"": name, "text_config": name, "vision_config": "sdpa"} if arch.has_vision else name
    extra = {} if config is None else {"config": config}
    model, info = getattr(transformers, class_name).from_pretrained(
        path,
        dtype=options.dtype,
        attn_implementation=attn,
        use_safetensors=True,
        output_loading_info=True,
        **extra,
    )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelLoadError(
            f"{path}: the checkpoint has no tensor {_names(missing)} that {class_name} needs "
            f"({len(missing)} missing); the folder is incomplete: copy every *.safetensors shard of the model"
        )
    mismatched = sorted(str(item[0]) for item in info.get("mismatched_keys") or ())
    if mismatched:
        raise ModelLoadError(
            f"{path}: tensor {_names(mismatched)} has another shape than config.json describes; "
            "the weights and config.json do not belong together"
        )
    if options.quantize is not None:
        try:
            quantize_model(model, options.quantize)
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
    return model.to(options.device), hf_processor, tokenizer


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:SHOWN])
    return shown + (", ..." if len(keys) > SHOWN else "")
