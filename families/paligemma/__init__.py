"""PaliGemma: the task prefixes its checkpoints were trained on, answers in 1024 location bins.

Prompts (PaliGemma has no chat template; its processor writes "<image>" x n, BOS, the prompt, "\\n"):
    caption  "caption en" (short, normal) / "describe en" (long)
    query    "answer en <question>"
    detect   "detect <object>": items `<locYMIN><locXMIN><locYMAX><locXMAX> <object>` joined by " ; "
    point    PaliGemma has no pointing task: "detect <object>", answered with the boxes' centres
    generate / chat  the prompt as written (one user message; write PaliGemma's prefixes yourself)
Every prompt needs an image: the prompt is a bidirectional prefix after the image. Answers decoded
without a grammar never hold the location and segmentation tokens (families/reserved.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.loader import LoadedModel, LoadOptions, assemble, load_transformers
from foveal.families.base import Capabilities, Family
from foveal.families.conversation import Conversation, single_user_message
from foveal.families.reserved import PALIGEMMA_RESERVED, reserved_ids
from foveal.families.scores import spatial_scores
from foveal.families.task import Task, box_centres, is_loc, spatial_task
from foveal.grammars import spatial
from foveal.grammars.locations import LocationFormat

PALIGEMMA = Architecture(
    "paligemma",
    ("PaliGemmaForConditionalGeneration",),
    processor_class="PaliGemmaProcessor",
    image_token="<image>",
    position_offset=1,
    prefix_attention=True,
    image_required=True,
    image_keys=("pixel_values",),
)

SKILLS = frozenset({"caption", "query", "detect", "point", "generate", "chat"})


class PaliGemmaFamily(Family):
    name = "paligemma"
    architectures: ClassVar[tuple[str, ...]] = PALIGEMMA.architectures
    BINS: ClassVar[int] = 1024
    CAPTION: ClassVar[dict[str, str]] = {"short": "caption en", "normal": "caption en", "long": "describe en"}

    def __init__(self, loaded: LoadedModel, capabilities: Capabilities | None = None) -> None:
        super().__init__(loaded, capabilities or Capabilities(SKILLS, vision=True, image_required=True))
        self.reserve(reserved_ids(self.tokenizer, PALIGEMMA_RESERVED))  # only detect and point write them

    @classmethod
    def load(cls, folder: Path, raw: dict, options: LoadOptions) -> Family:
        if options.image_options:
            raise ModelLoadError(
                "image_options are not supported for paligemma; its image processor has fixed sizes"
            )
        model, hf_processor, tokenizer = load_transformers(
            folder, raw, PALIGEMMA, PALIGEMMA.architectures[0], options
        )
        return cls.build(assemble(model, PALIGEMMA, tokenizer, hf_processor, str(folder), options), folder)

    @classmethod
    def build(cls, loaded: LoadedModel, folder: Path) -> Family:
        return cls(loaded)

    def caption(self, length: str) -> Task:
        return Task("caption", self.CAPTION[length])

    def query(self, question: str) -> Task:
        return Task("query", f"answer en {self.plain('question', question)}")

    def detect(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.boxes("loc", max_objects=max_objects, label=self._label(phrase), bins=self.BINS)
        return spatial_task("detect", f"detect {phrase}", spec)

    def point(self, phrase: str, max_objects: int) -> Task:
        spec = spatial.boxes("loc", max_objects=max_objects, label=self._label(phrase), bins=self.BINS)
        centres = lambda text: box_centres(spatial.parse(spec, text))  # noqa: E731
        # a centre's score is its box's
        return Task("point", f"detect {phrase}", spec, centres, True, score=lambda d: spatial_scores(spec, d))

    def generate(self, prompt: str, output_type: Any) -> Task:
        return Task("generate", self.plain("prompt", prompt), output_type, None, is_loc(output_type))

    def chat(self, conversation: Conversation, output_type: Any) -> Task:
        text = single_user_message(conversation, f"this {self.name} model").text
        return Task("chat", self.plain("message", text), output_type, None, is_loc(output_type))

    def _label(self, phrase: str) -> str:
        return LocationFormat(self.BINS).check_label(self.plain("object", phrase))
