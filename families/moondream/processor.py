"""`MoondreamProcessor`: a Moondream prompt (+ image) -> prompt ids and `PrefillInputs`.

Moondream's prompts are token ids, not text: template ids (from the config) around the user's text,
which is tokenized on its own (`MoondreamPrompt`). With an image the prompt is BOS, 729 placeholder
ids (their embeddings are replaced by the image's rows in the prefill launch), then the template;
BOS and the image rows are the bidirectional prefix (`prefix_len` 730), which depends on the image
alone, so the prefix cache (keyed by the image key and that prefix, kv_cache.prefix_seed) gives a
second call on one image its image pages (the reference caches this prefix too). Without an image it is BOS
then the template, causal from position 0 (the reference's text-only query).
The crops are cut and normalized here, on the caller's thread (PIL resizes are the slow part),
and moved to the runner's device and dtype; the tiling travels as a CPU tensor (the runner needs
it as host ints to stitch, and must not read the device for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from foveal.engine.models.processor import PromptInputs, to_pil
from foveal.engine.request import PrefillInputs

from . import vision
from .config import MoondreamConfig


@dataclass(frozen=True, slots=True)
class MoondreamPrompt:
    """Template ids around the user's text; `text` is tokenized without special tokens, as given
    (the skill adds the leading space where the reference does)."""

    prefix: tuple[int, ...]
    text: str = ""
    suffix: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{list(self.prefix)} {self.text!r} {list(self.suffix)}"


class MoondreamProcessor:
    def __init__(
        self, config: MoondreamConfig, tokenizer: Any, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype

    def ids(self, prompt: MoondreamPrompt) -> list[int]:
        """The template's ids with the text's ids between them (no BOS, no image)."""
        if not isinstance(prompt, MoondreamPrompt):
            raise TypeError(f"a Moondream prompt is a MoondreamPrompt, not {type(prompt).__name__}")
        text = self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"] if prompt.text else []
        return [*prompt.prefix, *text, *prompt.suffix]

    def __call__(
        self, prompt: MoondreamPrompt, image: Any = None, image_key: str | None = None
    ) -> PromptInputs:
        bos = self.config.tokenizer.bos_id
        ids = self.ids(prompt)
        if image is None:
            return PromptInputs([bos, *ids], None)
        v = self.config.vision
        crops, tiling = vision.crops(to_pil(image), v.max_crops, v.overlap_margin)
        pixels = vision.normalize(crops).to(self.device, self.dtype)
        tensors = {"pixels": pixels, "tiling": torch.tensor(tiling)}
        n = self.config.image_tokens
        # The prefix cache keys the pages by the image and the bidirectional prefix (BOS + image:
        # the same ids for every image), so calls on one image share them (kv_cache.prefix_seed). The
        # placeholders are BOS ids; the runner places image rows by position, so it has no use for
        # the engine's count of cached placeholders (`cached_image_tokens`, which counts BOS too).
        prefill = PrefillInputs(tensors, n, image_key, self.config.prefix_len, image_token_id=bos)
        return PromptInputs([bos, *([bos] * n), *ids], prefill)
