"""Molmo 2 on foveal's engine: load-time checks, an image processor without torchvision, the images-only
processor, the input processor and the runner.

PROBLEM
    transformers' Molmo2ImageProcessor is a torchvision backend (its resize and normalize call
    torchvision), and Molmo2Processor wants a video processor, which needs torchvision too. Molmo 2's
    image tokens (patches, column separators, the start / end tokens of each view) attend to each
    other both ways, across all the images of a prompt, while text stays causal. Its image token
    ids lie past the LM head's vocabulary (an extra embedding table), so the tokenizer is larger
    than the LM head's logits.
SOLUTION
    - `Molmo2ImagesProcessor`: Molmo2ImageProcessor with torchvision's two calls replaced by torch's
      own (`F.interpolate` bilinear without antialias, which is what torchvision's tensor resize
      runs; `(x - mean) / std`); crops, tiling and pooling indices are the real class's code.
    - `Molmo2ImagesOnly`: Molmo2Processor built from its image processor and tokenizer (the
      attributes its `__init__` sets, without the video processor); placeholder expansion,
      mm_token_type_ids and the chat template are the real class's code.
    - `Molmo2Runner`: HFRunner whose launches with images mark every image-block token
      (`image_token_ids`, what the processor's mm_token_type_ids marks) as one bidirectional block
      per sequence (attention.build_context's `blocks`), and whose image encoder call joins the
      launch's prompts: transformers before 5.25 takes pooling indices into the launch's joined
      patches (its processor offsets a prompt's images into the prompt's patches, and the runner
      each prompt into the launch's), 5.25 and later each image's own indices with the images' crop
      counts (`image_num_crops`), and offsets them itself. Its logits are padded with -inf
      columns for the ids past the LM head (the image tokens), so they cover the whole tokenizer.
    - `Molmo2InputProcessor`: the generic InputProcessor, plus `prefix_len` = the end of the last
      image block, so that the prefix cache shares a page only between prompts with the same images
      and the same tokens up to the last image token (an image token's K/V depends on every image
      token of its prompt, and so on the text between two images). Nothing reads `prefix_len` as
      attention here: the runner's architecture has no prefix attention.
INVARIANTS
    - A folder this module cannot run (no vision or adapter config, no image_patch_id, no Molmo 2
      image processor config, a tokenizer without Molmo's image tokens or with ordinary tokens past
      the LM head, a missing tensor) is refused at load, naming what is missing.
    - Every image-block token of a prompt sees every other one of that prompt; text tokens, and
      every decode step, are causal.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from transformers.models.molmo2.image_processing_molmo2 import Molmo2ImageProcessor
from transformers.processing_utils import ProcessorMixin

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.loader import IMAGE_PROCESSOR_FILES, image_processor_settings
from foveal.engine.models.processor import InputProcessor, PromptInputs
from foveal.engine.models.runner import HFRunner
from foveal.engine.request import PrefillInputs
from foveal.engine.runner import ForwardBatch

CLASS_NAME = "Molmo2ForConditionalGeneration"
IMAGE_TOKEN = "<|image|>"  # the prompt's placeholder, expanded by the processor
# The tokens of an image's views (what Molmo2Processor's mm_token_type_ids marks as image tokens).
BLOCK_TOKENS = (
    "<im_patch>",
    "<im_col>",
    "<im_start>",
    "<low_res_im_start>",
    "<frame_start>",
    "<im_end>",
    "<frame_end>",
    "<im_low>",
)

MOLMO2 = Architecture(
    "molmo2",
    (CLASS_NAME,),
    processor_class="Molmo2Processor",
    image_token=IMAGE_TOKEN,
    image_keys=("pixel_values", "image_token_pooling", "image_grids", "image_num_crops"),
    features_as_list=True,  # Molmo2Model concatenates mm_encoder_outputs' pooler_output list
)


# ---- load-time checks ---------------------------------------------------------------------------------------


def check_config(raw: Mapping[str, Any], path: Path) -> None:
    """Refuse a folder this module cannot run, before any weights are read (the message names what is missing)."""
    for name in ("vision_config", "adapter_config", "text_config"):
        if not isinstance(raw.get(name), Mapping):
            raise ModelLoadError(
                f"{path}: config.json of {CLASS_NAME} has no {name}; save the checkpoint's full config.json"
            )
    if raw.get("image_patch_id") is None:
        raise ModelLoadError(f"{path}: config.json of {CLASS_NAME} has no image_patch_id; save the checkpoint's own")
    settings = image_processor_settings(path)
    if settings is None:
        raise ModelLoadError(
            f"{path} has no image processor settings ({IMAGE_PROCESSOR_FILES}); save the Molmo 2 image processor with the model"
        )
    kind = settings.get("image_processor_type")
    if kind is None or not kind.startswith("Molmo2ImageProcessor"):
        raise ModelLoadError(
            f"{path}: the image processor settings name image_processor_type {kind!r}; a Molmo 2 folder needs "
            "Molmo2ImageProcessor's config (save the checkpoint's own image processor)"
        )
    if settings.get("resample", 2) != 2:
        raise ModelLoadError(
            f"{path}: the image processor resamples with {settings['resample']!r}; foveal's Molmo 2 image "
            "processor (without torchvision) resizes bilinearly only (resample 2)"
        )


def check_vocabulary(tokenizer: Any, text: Any, path: Path) -> None:
    """Tokens past the LM head may only be the extra table's special tokens (the image tokens)."""
    head = text.vocab_size
    table = head + text.additional_vocab_size
    if len(tokenizer) > table:
        raise ModelLoadError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens but the model embeds {table}: they do not "
            "belong together; save the checkpoint's own tokenizer"
        )
    special = set(tokenizer.all_special_ids)
    beyond = [i for i in range(head, len(tokenizer)) if i not in special]
    if beyond:
        raise ModelLoadError(
            f"{path}: tokens {beyond[:5]} lie past the LM head's {head} rows and are not special tokens; "
            "the tokenizer does not belong to this model"
        )


# ---- the image processor and the processor (no torchvision, no video) ---------------------------------------


class Molmo2ImagesProcessor(Molmo2ImageProcessor):
    """Molmo2ImageProcessor with its two torchvision calls done by torch (see the module docstring)."""

    def resize(self, image: torch.Tensor, size: Any, resample: Any = None, antialias: bool = True, **kwargs: Any):
        return F.interpolate(
            image, size=(size.height, size.width), mode="bilinear", align_corners=False, antialias=antialias
        )

    # (on torch tensors where the base class's works on numpy arrays: the processor's own calls pass tensors)
    def normalize(self, image: torch.Tensor, mean: Any, std: Any, inplace: bool = False, **kwargs: Any):  # type: ignore[override]
        mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
        return (image - mean) / std


class Molmo2ImagesOnly(transformers.Molmo2Processor):
    """Molmo2Processor from its image processor and tokenizer only (`ProcessorMixin.get_attributes` reads
    the parts from this `__init__`); sets what the parent's `__init__` sets, the video defaults included."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None):
        self.image_use_col_tokens = True
        self.use_single_crop_col_tokens = None
        self.use_single_crop_start_token = True
        self.video_use_col_tokens = False
        self.use_frame_special_tokens = True
        self.image_token = getattr(tokenizer, "image_token", IMAGE_TOKEN)
        self.video_token = getattr(tokenizer, "video_token", "<|video|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.image_token_ids = tokenizer.convert_tokens_to_ids(list(BLOCK_TOKENS))
        ProcessorMixin.__init__(self, image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def load_processor(path: Path) -> tuple[Any, Any]:
    """(hf processor, tokenizer) of a Molmo 2 folder."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for token in (IMAGE_TOKEN, *BLOCK_TOKENS):
        if tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id):
            raise ModelLoadError(f"{path}: the tokenizer has no {token} token; save the checkpoint's own tokenizer")
    image_processor = Molmo2ImagesProcessor.from_pretrained(path)
    return Molmo2ImagesOnly(image_processor, tokenizer, tokenizer.chat_template), tokenizer


class Molmo2InputProcessor(InputProcessor):
    """InputProcessor with `prefix_len` through the last image-block token (see the module docstring)."""

    def __init__(self, *args: Any, block_ids: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.block_ids = frozenset(block_ids)

    def __call__(self, text: str, image: Any = None, image_key: str | None = None, add_special_tokens: bool = True):
        prompt = super().__call__(text, image, image_key, add_special_tokens)
        if prompt.prefill is None:
            return prompt
        types = [int(t in self.block_ids) for t in prompt.token_ids]
        last = max(i for i, kind in enumerate(types) if kind)
        # not read by the runner: what transformers' own forward needs to make the image tokens bidirectional
        tokens = torch.tensor([types], dtype=torch.int64, device=self.device)
        prefill = PrefillInputs(
            {**prompt.prefill.image_tensors, "mm_token_type_ids": tokens},
            prompt.prefill.num_image_tokens,
            image_key,
            last + 1,
            prompt.prefill.image_token_id,
        )
        return PromptInputs(prompt.token_ids, prefill)


# ---- the runner -----------------------------------------------------------------------------------------------


class Molmo2Runner(HFRunner):
    """HFRunner with Molmo 2's bidirectional image blocks and per-prompt pooling offsets (module docstring)."""

    def __init__(self, model: torch.nn.Module, arch: Architecture, block_ids: list[int], **kwargs: Any) -> None:
        super().__init__(model, arch, **kwargs)  # LeanDecoder.supports refuses its layers: transformers' forward
        self.block_ids = torch.tensor(sorted(block_ids), dtype=torch.int64, device=self.device)
        # Logits cover the whole embedding table (the image tokens past the LM head get -inf), so that
        # every tokenizer id has a column and the grammar's masks fit the logits.
        text = model.config.get_text_config()  # type: ignore[union-attr, operator]  # nn.Module: Tensor | Module
        self.head_size: int = text.vocab_size
        self.vocab_size = text.vocab_size + text.additional_vocab_size
        # transformers 5.25 and later: each image's own pooling indices, offset by get_image_features
        self.per_image_pooling = "image_num_crops" in inspect.signature(model.get_image_features).parameters  # type: ignore[arg-type]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        logits = super().forward(batch)
        return F.pad(logits, (0, self.vocab_size - self.head_size), value=float("-inf"))

    def attention_blocks(self, batch: ForwardBatch) -> torch.Tensor | None:
        if not any(p is not None and p.num_image_tokens for p in batch.prefill):
            return None
        return torch.isin(batch.input_ids, self.block_ids)

    def encode_images(self, images: list[PrefillInputs]) -> list[torch.Tensor]:
        """Every prompt's features in one encoder call, its pooling indices as the installed
        transformers reads them (see the module docstring)."""
        joined = {key: torch.cat([image.image_tensors[key] for image in images]) for key in MOLMO2.image_keys}
        if self.per_image_pooling:
            pooled = self.model.get_image_features(**joined).pooler_output  # type: ignore[operator]  # (as in __init__)
        else:
            pooling, offset = [], 0
            for image in images:
                values, indices = image.image_tensors["pixel_values"], image.image_tensors["image_token_pooling"]
                pooling.append(torch.where(indices >= 0, indices + offset, indices))
                offset += values.shape[0] * values.shape[1]
            pooled = self.model.get_image_features(  # type: ignore[operator]
                joined["pixel_values"], torch.cat(pooling), joined["image_grids"]
            ).pooler_output
        flat = torch.cat(list(pooled))
        return list(flat.split([image.num_image_tokens for image in images]))
