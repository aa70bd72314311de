"""`Architecture`: what the generic runner and input processor need to know of a transformers model class.

The engine's runner (runner.py) and processor (processor.py) drive any transformers model whose
decoder runs on foveal's paged attention. What differs between such models is data, not code:
which processor class turns text + images into inputs, which of its outputs carry the image into
the forward, how positions count (PaliGemma's from 1), whether the prompt is a bidirectional
prefix, and how precomputed image features are handed back to the forward. A model family
(`foveal.families`) describes its checkpoints with one `Architecture` each; nothing here names a
family.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foveal.engine.request import PrefillInputs


class ModelLoadError(ValueError):
    """A checkpoint that foveal cannot load; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str  # the family's name, for messages
    architectures: tuple[str, ...]  # transformers class names (config.json "architectures")
    processor_class: str | None = None  # None: text-only, the tokenizer is the processor
    image_token: str | None = None  # placeholder the prompt must contain once (added in front if absent)
    position_offset: int = 0
    prefix_attention: bool = False  # the prompt (image + text) attends bidirectionally
    image_required: bool = False  # every prompt needs an image (the model has no text-only mode)
    image_keys: tuple[str, ...] = ()  # processor outputs that go to the forward with the image
    image_cat_dim: int = 0  # the images axis of those tensors, to join several sequences' images
    # How the model's forward takes precomputed features (`mm_encoder_outputs["image"].pooler_output`):
    # a list of [tokens, hidden] tensors (LLaVA, Idefics3 concatenate it) or one tensor (PaliGemma).
    features_as_list: bool = False

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
