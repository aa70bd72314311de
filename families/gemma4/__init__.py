"""Gemma 4 (image-text): chat prompts by its own template, detect / point as JSON under foveal's spatial grammar.

Prompts are the checkpoint's own chat template (`<|turn>user ... <turn|>`, images as `<|image|>`,
which the processor expands to BOI, the image's soft tokens, EOI), rendered through its processor as
transformers' `apply_chat_template` does. Several images may ride one call (each a turn part).

Gemma 4 was not trained on a grounding format foveal knows, so detect and point ask for foveal's
JSON shapes (coordinates normalized to [0, 1] from the top-left corner) and decode under
`foveal.grammars.spatial`, so every answer parses and every coordinate is inside the image:
    detect  "Find every <object> in the image. Answer with JSON {"objects": [{"x_min": .., "y_min": ..,
            "x_max": .., "y_max": ..}]}, coordinates normalized to [0, 1] from the top-left corner."
    point   "Point at every <object> in the image. Answer with JSON {"points": [{"x": .., "y": ..}]},
            coordinates normalized to [0, 1] from the top-left corner."
The boxes are as good as the model's instruction following (docs/models/gemma4.md).

The model: model.py (sliding and full attention on paged KV, per-layer embeddings, KV sharing).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.loader import LoadOptions, assemble
from foveal.engine.models.strict import load_strict
from foveal.families.chat import ChatFamily
from foveal.families.gemma4.model import (
    CLASS_NAME,
    GEMMA4,
    Gemma4Runner,
    check_config,
    load_processor,
    text_only_config,
)


class Gemma4Family(ChatFamily):
    table: ClassVar[tuple[Architecture, ...]] = (GEMMA4,)
    architectures: ClassVar[tuple[str, ...]] = GEMMA4.architectures
    MAX_IMAGES: ClassVar[int] = 8  # images per call (the parity tests run prompts of one and two)

    @classmethod
    def load(cls, folder: Path, raw: dict, options: LoadOptions) -> Gemma4Family:
        if options.image_options:
            raise ModelLoadError(
                "image_options are not supported for gemma4; its image processor sets the resolution "
                "(max_soft_tokens in preprocessor_config.json)"
            )
        check_config(raw, folder)
        model, hf_processor, tokenizer = load_strict(
            folder, GEMMA4, CLASS_NAME, options, lambda: load_processor(folder), config=text_only_config(folder)
        )
        arch = replace(GEMMA4, image_token=tokenizer.image_token)
        loaded = assemble(model, arch, tokenizer, hf_processor, str(folder), options, runner_class=Gemma4Runner)
        return cls(loaded, arch, hf_processor)


__all__ = ["Gemma4Family"]
