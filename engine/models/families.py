"""Supported model families: how each architecture maps onto the generic runner and processor.

A family is data, not code: which transformers architectures it covers, which processor class
turns text + image into model inputs, how its positions count (PaliGemma from 1), whether its
prompt is a bidirectional prefix (PaliGemma), and which processor outputs carry the image into
the forward. Adding a family that transformers already implements is one entry here plus a
parity test.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from foveal.engine.request import PrefillInputs


class ModelLoadError(ValueError):
    """A checkpoint that foveal cannot load; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    processor_class: str | None = None  # None: text-only, the tokenizer is the processor
    image_token: str | None = None  # placeholder the prompt must contain once (added in front if absent)
    position_offset: int = 0
    prefix_attention: bool = False
    image_keys: tuple[str, ...] = ()  # processor outputs that go to the forward with the image
    image_cat_dim: int = 0  # the images axis of those tensors, to join several sequences' images
    # How the model's forward takes precomputed features (`mm_encoder_outputs["image"].pooler_output`):
    # a list of [tokens, hidden] tensors (LLaVA, Idefics3 concatenate it) or one tensor (PaliGemma).
    features_as_list: bool = False
    # A module (dotted path) with the family's own loading code where data is not enough (qwen_vl.py:
    # check_config, load_processor, make_runner, make_input_processor); None: the generic runner.
    adapter: str | None = None

    @property
    def has_vision(self) -> bool:
        return self.processor_class is not None

    def image_kwargs(self, images: list[PrefillInputs]) -> dict[str, torch.Tensor]:
        """Join the image tensors of one launch's sequences, in sequence order (the placeholder order)."""
        if not images or not self.image_keys:
            return {}
        return {
            key: torch.cat([image.image_tensors[key] for image in images], dim=self.image_cat_dim)
            for key in self.image_keys
        }


IDEFICS3 = Family(
    "idefics3",
    ("Idefics3ForConditionalGeneration",),
    processor_class="Idefics3Processor",
    image_token="<image>",
    image_keys=("pixel_values", "pixel_attention_mask"),
    image_cat_dim=1,
    features_as_list=True,
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",)),
    Family("gemma", ("GemmaForCausalLM",)),
    Family(
        "paligemma",
        ("PaliGemmaForConditionalGeneration",),
        processor_class="PaliGemmaProcessor",
        image_token="<image>",
        position_offset=1,
        prefix_attention=True,
        image_keys=("pixel_values",),
    ),
    IDEFICS3,
    # SmolVLM is Idefics3's architecture; its own SmolVLMProcessor cannot be built without torchvision
    # (video), and for images it expands prompts as Idefics3Processor does, which we use instead.
    replace(IDEFICS3, name="smolvlm", architectures=("SmolVLMForConditionalGeneration",)),
    # Moondream 2 is foveal's own implementation (engine/models/moondream), not a transformers class;
    # its processor is MoondreamProcessor, its loader moondream/loader.py.
    Family("moondream", ("HfMoondream",), processor_class="MoondreamProcessor"),
    Family(
        "llava",
        ("LlavaForConditionalGeneration",),
        processor_class="LlavaProcessor",
        image_token="<image>",
        image_keys=("pixel_values",),
        features_as_list=True,
    ),
    # M-RoPE, their processors without the video part, Qwen3-VL's DeepStack: engine/models/qwen_vl.py.
    Family(
        "qwen2_5_vl",
        ("Qwen2_5_VLForConditionalGeneration",),
        processor_class="Qwen2_5_VLProcessor",
        image_token="<|vision_start|><|image_pad|><|vision_end|>",
        image_keys=("pixel_values", "image_grid_thw"),
        features_as_list=True,
        adapter="foveal.engine.models.qwen_vl",
    ),
    Family(
        "qwen3_vl",
        ("Qwen3VLForConditionalGeneration",),
        processor_class="Qwen3VLProcessor",
        image_token="<|vision_start|><|image_pad|><|vision_end|>",
        image_keys=("pixel_values", "image_grid_thw"),
        features_as_list=True,
        adapter="foveal.engine.models.qwen_vl",
    ),
)


def supported_architectures() -> list[str]:
    return [arch for family in FAMILIES for arch in family.architectures]


def family_named(name: str) -> Family:
    return next(family for family in FAMILIES if family.name == name)


def family_for(architectures: list[str] | None) -> tuple[Family, str]:
    """The family and architecture name of a config's `architectures` list; raises with the supported list."""
    for arch in architectures or []:
        for family in FAMILIES:
            if arch in family.architectures:
                return family, arch
    raise ModelLoadError(
        f"unsupported architecture {architectures!r}; foveal supports: {', '.join(supported_architectures())}. "
        "Use a checkpoint of one of these, or add a family in foveal/engine/models/families.py."
    )
