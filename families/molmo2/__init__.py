"""Molmo 2: chat prompts by its own template, points in its native format, counting by points, no boxes.

Prompts are the checkpoint's own chat template rendered through its processor (images as
`<|image|>`, which the processor expands to each image's low-resolution and high-resolution views).
Several images may ride one call.

Molmo 2 was trained to point, not to draw boxes: `point` asks in its pointing form,
    "Point to the <object>.\\nPlease say 'There are none.' if it is not in the image."
and decodes its native answer (`<points coords="1 1 073 160 ...">object</points>`, thousandths of the
image) under a grammar that keeps every point inside the image (answers.py), returned as foveal's
normalized points. Counting is the number of points (`len(model.point(image, "car")["points"])`,
what Molmo 2's own counting answers are built from). `detect` is refused, naming `point`.

The model: model.py (bidirectional image tokens, the image processor without torchvision).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.loader import LoadedModel, LoadOptions, assemble
from foveal.engine.models.strict import load_strict
from foveal.families.base import UnsupportedSkill
from foveal.families.chat import ChatFamily
from foveal.families.molmo2.answers import MolmoPointsSpec, point_scores
from foveal.families.molmo2.model import (
    BLOCK_TOKENS,
    CLASS_NAME,
    MOLMO2,
    Molmo2InputProcessor,
    Molmo2Runner,
    check_config,
    check_vocabulary,
    load_processor,
)
from foveal.families.task import Task

POINT_ASK = "Point to the {}.\nPlease say 'There are none.' if it is not in the image."


class Molmo2Family(ChatFamily):
    table: ClassVar[tuple[Architecture, ...]] = (MOLMO2,)
    architectures: ClassVar[tuple[str, ...]] = MOLMO2.architectures
    MAX_IMAGES: ClassVar[int] = 8  # images per call (the parity tests run prompts of one and two)

    def __init__(self, loaded: LoadedModel, arch: Architecture, hf_processor: Any = None) -> None:
        super().__init__(loaded, arch, hf_processor)
        self.capabilities = replace(self.capabilities, skills=self.capabilities.skills - {"detect"})

    @property
    def image_min_size(self) -> None:
        """None: the crops and tiling depend on the image's own size, so images are decoded in full."""
        return None

    @classmethod
    def load(cls, folder: Path, raw: dict, options: LoadOptions) -> Molmo2Family:
        if options.image_options:
            raise ModelLoadError(
                "image_options are not supported for molmo2; its image processor sets the crops "
                "(max_crops in preprocessor_config.json)"
            )
        check_config(raw, folder)
        model, hf_processor, tokenizer = load_strict(folder, MOLMO2, CLASS_NAME, options, lambda: load_processor(folder))
        check_vocabulary(tokenizer, model.config.text_config, folder)
        blocks = tokenizer.convert_tokens_to_ids(list(BLOCK_TOKENS))
        runner = functools.partial(Molmo2Runner, block_ids=blocks)
        processor = lambda runner: Molmo2InputProcessor(  # noqa: E731
            MOLMO2,
            tokenizer,
            hf_processor,
            runner.device,
            runner.dtype,
            model.config.image_patch_id,
            block_ids=blocks,
        )
        loaded = assemble(
            model, MOLMO2, tokenizer, hf_processor, str(folder), options, runner_class=runner, processor=processor
        )
        return cls(loaded, MOLMO2, hf_processor)

    def detect(self, phrase: str, max_objects: int) -> Task:
        raise self.unsupported("detect")

    def unsupported(self, skill: str) -> UnsupportedSkill:
        if skill == "detect":
            return UnsupportedSkill(
                "Molmo 2 points at objects and draws no boxes: use point (its points, or their count with "
                "len(result['points']))"
            )
        return super().unsupported(skill)

    def point(self, phrase: str, max_objects: int) -> Task:
        label = self.plain("object", phrase)
        spec = MolmoPointsSpec("points", max_objects=max_objects, label=label)
        return Task(
            "point", POINT_ASK.format(label), spec, lambda text: spec.parse_answer(text)["points"], score=point_scores
        )


__all__ = ["Molmo2Family"]
