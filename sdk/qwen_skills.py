"""Skills of Qwen2.5-VL and Qwen3-VL: chat prompts, and detect / point in each family's native grounding format.

Both families were trained to answer grounding requests with fenced JSON items,
`{"bbox_2d": [x1, y1, x2, y2], "label": ..}` and `{"point_2d": [x, y], "label": ..}` (the Qwen-VL
cookbooks' prompts: "Locate every X in the image and output the bbox coordinates in JSON format."),
but on different scales:
- Qwen2.5-VL: absolute pixels of the *resized* input image (what the processor's smart resize made of
  the picture: image_grid_thw x patch size), so the answer's grammar and its conversion depend on the
  image. The task is bound to the processed prompt (`Task.for_prompt`) once the processor has run.
- Qwen3-VL: relative coordinates in 0..1000 whatever the image.
The answer is decoded under `foveal.grammars.grounding` (format, ranges, x1 < x2, y1 < y2,
max_objects) and converted to foveal's `{"objects": [{x_min, ..}]}` / `{"points": [{x, y}]}`, fractions
of the image (the resize maps the whole picture onto the whole input, so fractions of the input are
fractions of the original). Caption, query and generate are `ChatSkills`' chat prompts, with Qwen's
image placeholder `<|vision_start|><|image_pad|><|vision_end|>`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from foveal.grammars.grounding import GroundingSpec
from foveal.results import DetectResult, PointResult, Result
from foveal.skills import ChatSkills, Task, _spatial_task

RELATIVE_SCALE = 1000  # Qwen3-VL's coordinates: thousandths of the image


class QwenSkills(ChatSkills):
    """ChatSkills with Qwen-VL's native grounding; `absolute`: Qwen2.5-VL's pixels of the resized input."""

    name = "qwen"
    ASK = {
        "boxes": "Locate every {} in the image and output the bbox coordinates in JSON format.",
        "points": "Locate every {} in the image and output the point coordinates in JSON format.",
    }

    def __init__(
        self,
        tokenizer: Any,
        image_token: str | None,
        absolute: bool,
        resized_sizes: Callable[[Any], list[tuple[int, int]]] | None = None,
    ) -> None:
        super().__init__(tokenizer, image_token)
        if absolute and resized_sizes is None:
            raise ValueError("absolute (Qwen2.5-VL) coordinates need the processor's resized image sizes")
        self.absolute = absolute
        self.resized_sizes = resized_sizes

    def detect(self, phrase: str, max_objects: int) -> Task:
        return self._grounding(DetectResult, "boxes", phrase, max_objects)

    def point(self, phrase: str, max_objects: int) -> Task:
        return self._grounding(PointResult, "points", phrase, max_objects)

    def _grounding(self, result: type[Result], kind: str, phrase: str, max_objects: int) -> Task:
        label = self.plain("object", phrase)
        scale = None if self.absolute else RELATIVE_SCALE
        spec = GroundingSpec(kind, max_objects=max_objects, label=label, width=scale, height=scale)
        task = self._task(result, self.ASK[kind].format(label), spec)
        return replace(task, for_prompt=self._bind) if self.absolute else task

    def _bind(self, task: Task, prompt: Any) -> Task:
        """The task on the processed image's scale: Qwen2.5-VL answers in pixels of the resized input."""
        sizes = self.resized_sizes(prompt.prefill) if prompt.prefill is not None else []
        if len(sizes) != 1:
            raise ValueError(f"{task.skill} takes exactly one image; got {len(sizes)}")
        width, height = sizes[0]
        spec = replace(task.spec, width=width, height=height)
        return replace(
            _spatial_task(task.result, task.prompt, spec), prompt_without_image=task.prompt_without_image
        )
