"""Qwen2.5-VL and Qwen3-VL: chat prompts by their own template, detect / point in their trained grounding format.

Both families were trained to answer grounding requests with fenced JSON items,
`{"bbox_2d": [x1, y1, x2, y2], "label": ..}` and `{"point_2d": [x, y], "label": ..}` (the Qwen-VL
cookbooks' prompts: "Locate every X in the image and output the bbox coordinates in JSON format."),
but on different scales:
- Qwen2.5-VL: absolute pixels of the *resized* input image (what the processor's smart resize made of
  the picture: image_grid_thw x patch size), so the answer's grammar and its conversion depend on the
  image: `encode` binds the task to the processed prompt once the processor has run.
- Qwen3-VL: relative coordinates in 0..1000 whatever the image.
Qwen2.5-VL points, as its cookbook asks for them ("point to the X, output its coordinates in XML format
<points x y>object</points>"), answer one fenced element `<points x1=".." y1=".." alt="X">X</points>`
in pixels of the resized input (`grounding.XmlPointsSpec`); Qwen3-VL points stay JSON.
The answer is decoded under `foveal.families.qwen_vl.grounding` (format, ranges, x1 < x2, y1 < y2,
max_objects) and converted to foveal's `{"objects": [{x_min, ..}]}` / `{"points": [{x, y}]}`, fractions
of the image (the resize maps the whole picture onto the whole input, so fractions of the input are
fractions of the original). Caption, query, generate and chat are `ChatFamily`'s, with several images
per call. The runner and processor (M-RoPE, DeepStack, the processor without its video part) are in
`model.py`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from PIL import Image

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.loader import LoadOptions, assemble, load_transformers
from foveal.engine.models.processor import PromptInputs
from foveal.families.chat import ChatFamily, architecture_for
from foveal.families.qwen_vl import model as qwen
from foveal.families.qwen_vl.grounding import GroundingSpec, XmlPointsSpec
from foveal.families.task import Task, spatial_task

RELATIVE_SCALE = 1000  # Qwen3-VL's coordinates: thousandths of the image

QWEN2_5_VL = Architecture(
    "qwen2_5_vl",
    ("Qwen2_5_VLForConditionalGeneration",),
    processor_class="Qwen2_5_VLProcessor",
    image_token=qwen.PLACEHOLDER,
    image_keys=("pixel_values", "image_grid_thw"),
    features_as_list=True,
)
QWEN3_VL = replace(
    QWEN2_5_VL,
    name="qwen3_vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    processor_class="Qwen3VLProcessor",
)
ARCHITECTURES = (QWEN2_5_VL, QWEN3_VL)


class QwenVLFamily(ChatFamily):
    table: ClassVar[tuple[Architecture, ...]] = ARCHITECTURES
    architectures: ClassVar[tuple[str, ...]] = tuple(a for arch in ARCHITECTURES for a in arch.architectures)
    MAX_IMAGES: ClassVar[int] = 16  # several images in one prompt are covered by the parity tests
    ASK: ClassVar[dict[str, str]] = {
        "boxes": "Locate every {} in the image and output the bbox coordinates in JSON format.",
        "points": "Locate every {} in the image and output the point coordinates in JSON format.",
    }
    # the Qwen2.5-VL cookbook's pointing prompt (spatial_understanding.ipynb)
    XML_POINTS_ASK: ClassVar[str] = "point to the {}, output its coordinates in XML format <points x y>object</points>"

    @property
    def image_min_size(self) -> None:
        """None: the processor's grid depends on the image's own size, so images are decoded in full."""
        return None

    @property
    def absolute(self) -> bool:
        """Qwen2.5-VL answers in pixels of the resized input; Qwen3-VL in thousandths."""
        return self.arch.name == "qwen2_5_vl"

    @classmethod
    def load(cls, folder: Path, raw: dict, options: LoadOptions) -> QwenVLFamily:
        arch, class_name = architecture_for(raw.get("architectures"), cls.table)
        qwen.check_config(raw, folder)
        processor = lambda: qwen.load_processor(arch, folder, options.image_options)  # noqa: E731
        model, hf_processor, tokenizer = load_transformers(folder, raw, arch, class_name, options, processor)
        loaded = assemble(
            model,
            arch,
            tokenizer,
            hf_processor,
            str(folder),
            options,
            runner_class=qwen.QwenVLRunner,
            processor=lambda runner: qwen.QwenInputProcessor(arch, tokenizer, hf_processor, model, runner),
        )
        return cls(loaded, arch, hf_processor)

    def detect(self, phrase: str, max_objects: int) -> Task:
        return self._grounding("detect", "boxes", phrase, max_objects)

    def point(self, phrase: str, max_objects: int) -> Task:
        return self._grounding("point", "points", phrase, max_objects)

    def _grounding(self, skill: str, kind: str, phrase: str, max_objects: int) -> Task:
        label = self.plain("object", phrase)
        if self.absolute and kind == "points":  # Qwen2.5-VL was trained to point in XML (module docstring)
            spec: GroundingSpec = XmlPointsSpec("points", max_objects=max_objects, label=label)
            return spatial_task(skill, self.XML_POINTS_ASK.format(label), spec)
        scale = None if self.absolute else RELATIVE_SCALE
        spec = GroundingSpec(kind, max_objects=max_objects, label=label, width=scale, height=scale)
        return spatial_task(skill, self.ASK[kind].format(label), spec)

    def encode(self, task: Task, images: list[Image.Image], image_key: str | None) -> tuple[PromptInputs, Task]:
        prompt, task = super().encode(task, images, image_key)
        if self.absolute and isinstance(task.spec, GroundingSpec):
            task = self._bind(task, prompt)
        return prompt, task

    def _bind(self, task: Task, prompt: Any) -> Task:
        """The task on the processed image's scale: Qwen2.5-VL answers in pixels of the resized input."""
        sizes = self.processor.resized_sizes(prompt.prefill) if prompt.prefill is not None else []
        if len(sizes) != 1:
            raise ValueError(f"{task.skill} takes exactly one image; got {len(sizes)}")
        width, height = sizes[0]
        return spatial_task(task.skill, task.prompt, replace(task.spec, width=width, height=height))


__all__ = ["ARCHITECTURES", "ModelLoadError", "QwenVLFamily"]
