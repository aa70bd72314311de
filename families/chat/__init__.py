"""Chat and instruct families on transformers' modules: Llama-style and Gemma text models, Idefics3 /
SmolVLM and LLaVA vision models (also a llama .gguf file).

Prompts are the model's own chat template (`template.py`): a skill call is one user turn (the image,
then the ask), a `chat` call the whole conversation. Captions and questions are free text; detect and
point ask for JSON in the shapes of `foveal.grammars.spatial` (coordinates in [0, 1] from the top-left
corner) and decode under that grammar:
    detect  "Find every <object> in the image. Answer with JSON {"objects": [{"x_min": .., "y_min": ..,
            "x_max": .., "y_max": ..}]}, coordinates normalized to [0, 1] from the top-left corner."
    point   "Point at every <object> in the image. Answer with JSON {"points": [{"x": .., "y": ..}]},
            coordinates normalized to [0, 1] from the top-left corner."
None of these models was trained on that format, so their boxes are as good as their instruction
following; Qwen-VL (`foveal.families.qwen_vl`) asks in its own trained format instead.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from PIL import Image

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.loader import LoadedModel, LoadOptions, assemble, load_gguf, load_transformers
from foveal.engine.models.processor import PromptInputs
from foveal.families.base import Capabilities, Family
from foveal.families.conversation import Conversation, single_user_message, task_conversation
from foveal.families.task import Task, is_loc, spatial_task
from foveal.families.template import ChatTemplate
from foveal.grammars import spatial

IDEFICS3 = Architecture(
    "idefics3",
    ("Idefics3ForConditionalGeneration",),
    processor_class="Idefics3Processor",
    image_token="<image>",
    image_keys=("pixel_values", "pixel_attention_mask"),
    image_cat_dim=1,
    features_as_list=True,
)

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", ("LlamaForCausalLM",)),
    Architecture("gemma", ("GemmaForCausalLM",)),
    IDEFICS3,
    # SmolVLM is Idefics3's architecture; its own SmolVLMProcessor cannot be built without torchvision
    # (video), and for images it expands prompts as Idefics3Processor does, which is used instead.
    replace(IDEFICS3, name="smolvlm", architectures=("SmolVLMForConditionalGeneration",)),
    Architecture(
        "llava",
        ("LlavaForConditionalGeneration",),
        processor_class="LlavaProcessor",
        image_token="<image>",
        image_keys=("pixel_values",),
        features_as_list=True,
    ),
)

TEXT_SKILLS = frozenset({"query", "generate", "chat"})
VISION_SKILLS = frozenset({"caption", "query", "detect", "point", "generate", "chat"})


def architecture_for(
    names: list[str] | None, table: tuple[Architecture, ...] = ARCHITECTURES
) -> tuple[Architecture, str]:
    """The architecture and transformers class name of a config's `architectures` list."""
    for name in names or []:
        for arch in table:
            if name in arch.architectures:
                return arch, name
    raise ModelLoadError(f"unsupported architecture {names!r}")


class ChatFamily(Family):
    table: ClassVar[tuple[Architecture, ...]] = ARCHITECTURES
    architectures: ClassVar[tuple[str, ...]] = tuple(a for arch in ARCHITECTURES for a in arch.architectures)
    CAPTION: ClassVar[dict[str, str]] = {
        "short": "Describe this image in one short sentence.",
        "normal": "Describe this image.",
        "long": "Describe this image in detail.",
    }

    MAX_IMAGES: ClassVar[int] = 1  # one image per call: what these families' parity tests cover

    def __init__(self, loaded: LoadedModel, arch: Architecture, hf_processor: Any = None) -> None:
        self.name = arch.name
        self.arch = arch
        self.template = ChatTemplate(loaded.tokenizer, hf_processor, arch.image_token)
        vision = arch.has_vision
        capabilities = Capabilities(
            skills=VISION_SKILLS if vision else TEXT_SKILLS,
            vision=vision,
            image_required=arch.image_required,
            max_images=self.MAX_IMAGES if vision else 0,
            conversations=self.template.available,
        )
        super().__init__(loaded, capabilities)

    # ---- loading -----------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, folder: Path, raw: dict, options: LoadOptions) -> ChatFamily:
        arch, class_name = architecture_for(raw.get("architectures"), cls.table)
        if options.image_options:
            raise ModelLoadError(
                f"image_options are not supported for {arch.name}; its image processor has fixed sizes"
            )
        model, hf_processor, tokenizer = load_transformers(folder, raw, arch, class_name, options)
        loaded = assemble(model, arch, tokenizer, hf_processor, str(folder), options)
        return cls(loaded, arch, hf_processor)

    @classmethod
    def load_gguf(cls, path: Path, options: LoadOptions) -> ChatFamily:
        loaded, arch = load_gguf(path, options, lambda names: architecture_for(names, cls.table))
        return cls(loaded, arch)

    # ---- skills ------------------------------------------------------------------------------------------------

    def caption(self, length: str) -> Task:
        return Task("caption", self.CAPTION[length])

    def query(self, question: str) -> Task:
        return Task("query", self.plain("question", question))

    def detect(self, phrase: str, max_objects: int) -> Task:
        ask = (
            f"Find every {self.plain('object', phrase)} in the image. Answer with JSON "
            '{"objects": [{"x_min": .., "y_min": .., "x_max": .., "y_max": ..}]}, '
            "coordinates normalized to [0, 1] from the top-left corner."
        )
        return spatial_task("detect", ask, spatial.boxes("json", max_objects=max_objects))

    def point(self, phrase: str, max_objects: int) -> Task:
        ask = (
            f"Point at every {self.plain('object', phrase)} in the image. Answer with JSON "
            '{"points": [{"x": .., "y": ..}]}, coordinates normalized to [0, 1] from the top-left corner.'
        )
        return spatial_task("point", ask, spatial.points("json", max_objects=max_objects))

    def generate(self, prompt: str, output_type: Any) -> Task:
        return Task("generate", self.plain("prompt", prompt), output_type, None, is_loc(output_type))

    def chat(self, conversation: Conversation, output_type: Any) -> Task:
        self.plain_conversation(conversation)
        if not self.capabilities.conversations:
            single_user_message(conversation, "this checkpoint")
        return Task("chat", conversation, output_type, None, is_loc(output_type))

    # ---- encoding ----------------------------------------------------------------------------------------------

    def encode(self, task: Task, images: list[Image.Image], image_key: str | None) -> tuple[PromptInputs, Task]:
        conversation = self.conversation(task, len(images))
        text, special = self.template.render(conversation)
        return self.processor(text, images or None, image_key=image_key, add_special_tokens=special), task

    def conversation(self, task: Task, images: int) -> Conversation:
        """The task's conversation: a chat call's own, or one user turn with the call's images."""
        return task_conversation(task.prompt, images)
