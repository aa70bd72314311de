"""`InputProcessor`: text + optional image -> prompt token ids + the `PrefillInputs` of one request.

It wraps the family's own transformers processor (tokenizer, image processor, placeholder
expansion), so a prompt is tokenized exactly as the reference model expects. Image tensors are
moved to the runner's device and dtype here, before the request reaches the engine, so a launch
never copies from the host. PaliGemma's bidirectional prefix is the processor's token_type_ids == 0.
`PrefillInputs.num_image_tokens` counts the prompt's image placeholder tokens (the model's
`image_token_id`): the number of feature rows the image fills, by which the runner splits a batch of
encoded images. The caller's `image_key` (the image's content key) is carried for the runner's cache.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from foveal.engine.models.arch import Architecture
from foveal.engine.request import PrefillInputs


@dataclass(slots=True)
class PromptInputs:
    token_ids: list[int]
    prefill: PrefillInputs | None  # None for a text-only prompt


def to_pil(image: Any) -> Image.Image:
    """A PIL RGB image from a PIL image, a path, encoded bytes or an HxWx3 uint8 array."""
    if isinstance(image, Image.Image):  # decoded by foveal.vision: already RGB, not copied again
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, (str, Path)):
        return Image.open(image).convert("RGB")
    if isinstance(image, bytes):
        return Image.open(io.BytesIO(image)).convert("RGB")
    if isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[2] == 3:
        return Image.fromarray(image.astype(np.uint8))
    raise TypeError(
        f"image must be a PIL image, a path, bytes or an HxWx3 uint8 array, not {type(image).__name__}"
    )


class InputProcessor:
    """Callable `(text, images=None, image_key=None) -> PromptInputs` for one loaded model."""

    def __init__(
        self,
        arch: Architecture,
        tokenizer: Any,
        hf_processor: Any,
        device: torch.device,
        dtype: torch.dtype,
        image_token_id: int | None = None,
    ):
        if arch.has_vision and image_token_id is None:
            raise ValueError(f"a {arch.name} processor needs the model config's image_token_id")
        self.arch = arch
        self.image_token_id = image_token_id
        self.tokenizer = tokenizer
        self.hf_processor = hf_processor
        self.device = device
        self.dtype = dtype

    def __call__(
        self, text: str, image: Any = None, image_key: str | None = None, add_special_tokens: bool = True
    ) -> PromptInputs:
        """Prompt ids and PrefillInputs of `text` with one image, a list of images, or none. A prompt
        rendered by a chat template that already holds BOS is tokenized with add_special_tokens=False."""
        pictures = [] if image is None else list(image) if isinstance(image, (list, tuple)) else [image]
        if not pictures:
            return self._text_only(text, add_special_tokens)
        if not self.arch.has_vision:
            raise ValueError(f"{self.arch.name} is a text-only model; call it with image=None")
        if self.arch.image_token and self.arch.image_token not in text:
            text = self.arch.image_token * len(pictures) + text
        # Only the non-default is passed: PaliGemma's processor places BOS itself.
        special = {} if add_special_tokens else {"add_special_tokens": False}
        out = self.hf_processor(images=[to_pil(one) for one in pictures], text=[text], return_tensors="pt", **special)
        tensors = {}
        for key in self.arch.image_keys:
            value = out[key]
            dtype = self.dtype if value.is_floating_point() else value.dtype
            tensors[key] = value.to(self.device, dtype)
        ids = out["input_ids"][0]
        prefix_len = int((out["token_type_ids"][0] == 0).sum()) if self.arch.prefix_attention else 0
        num_image_tokens = int((ids == self.image_token_id).sum())
        prefill = PrefillInputs(tensors, num_image_tokens, image_key, prefix_len, self.image_token_id)
        return PromptInputs(ids.tolist(), prefill)

    def _text_only(self, text: str, add_special_tokens: bool = True) -> PromptInputs:
        if self.arch.image_required:
            raise ValueError(f"{self.arch.name} needs an image with every prompt; pass image=...")
        return PromptInputs(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"], None)
