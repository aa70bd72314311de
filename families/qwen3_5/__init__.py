"""Qwen3.5 (image-text, hybrid attention): Qwen3-VL's prompts and grounding on a hybrid decoder.

Prompts, skills and grounding are Qwen3-VL's (`foveal.families.qwen_vl`): the checkpoint's own chat
template, detect / point in its trained JSON grounding format on 0..1000, decoded under
`foveal.families.qwen_vl.grounding`. The decoder is hybrid (Gated DeltaNet linear attention between
full-attention layers); its recurrent state lives beside the paged KV, one snapshot per page, so the
prefix cache shares states with pages (model.py, engine/models/recurrent.py, docs/models/qwen3_5.md).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from foveal.engine.models.arch import Architecture
from foveal.engine.models.loader import LoadOptions, assemble
from foveal.engine.models.strict import load_strict
from foveal.families.qwen3_5.model import Qwen35Runner, check_hybrid
from foveal.families.qwen_vl import QWEN3_VL, QwenVLFamily
from foveal.families.qwen_vl import model as qwen

CLASS_NAME = "Qwen3_5ForConditionalGeneration"
QWEN3_5 = replace(QWEN3_VL, name="qwen3_5", architectures=(CLASS_NAME,))


class Qwen35Family(QwenVLFamily):
    table: ClassVar[tuple[Architecture, ...]] = (QWEN3_5,)
    architectures: ClassVar[tuple[str, ...]] = QWEN3_5.architectures

    @classmethod
    def load(cls, folder: Path, raw: dict, options: LoadOptions) -> Qwen35Family:
        qwen.check_config(raw, folder)
        check_hybrid(raw, folder)
        processor = lambda: qwen.load_processor(QWEN3_5, folder, options.image_options)  # noqa: E731
        model, hf_processor, tokenizer = load_strict(folder, QWEN3_5, CLASS_NAME, options, processor)
        loaded = assemble(
            model,
            QWEN3_5,
            tokenizer,
            hf_processor,
            str(folder),
            options,
            runner_class=Qwen35Runner,
            processor=lambda runner: qwen.QwenInputProcessor(QWEN3_5, tokenizer, hf_processor, model, runner),
        )
        return cls(loaded, QWEN3_5, hf_processor)


__all__ = ["Qwen35Family"]
