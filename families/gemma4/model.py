"""Gemma 4 (image-text) on foveal's engine: load-time checks, the images-only processor and the runner.

PROBLEM
    Gemma 4's text decoder mixes sliding-window and full-attention layers whose K/V differ in shape
    (full layers have their own head size, and may have their own KV head count), feeds every layer
    a per-layer input embedding (PLE) besides the residual stream, and in its small checkpoints lets
    the last layers reuse the K/V of earlier ones (KV sharing). Its processor class wants an audio
    feature extractor and a video processor, and transformers' video processors need torchvision.
SOLUTION
    The runner is HFRunner over transformers' own Gemma4ForConditionalGeneration, so PLE (which
    transformers computes from the input ids, image tokens as padding), the proportional rotary of
    full layers, the k = v projection and the MoE blocks are transformers' code. What is foveal's:
    - the paged KV layout (`layout_kv`): one KV tensor per layer that computes K/V, of that layer's
      own (kv heads, head size); a KV-sharing layer reads its producer's tensor (the last earlier
      layer of its attention type, as transformers' `kv_sharing_modes` pairs them) and writes none;
    - the sliding window, applied by the paged attention to the layers transformers marks sliding
      (attention.py: a query at position p sees keys p - window + 1 .. p);
    - `Gemma4ImagesOnly`: the real processor class's placeholder expansion (`<|image|>` -> BOI,
      one soft token per pooled patch group, EOI) and chat template, built from the image
      processor and the tokenizer alone;
    - the audio tower is not loaded (config.audio_config = None): foveal runs images and text.
INVARIANTS
    - A folder this module cannot run (no vision_config, no image_token_id, bidirectional attention
      over images, no image processor config, a tokenizer without Gemma 4's image tokens, a missing
      tensor) is refused at load, naming what is missing, before the weights are read (a missing
      tensor: while they are).
    - A sliding layer never sees a key beyond its window; a sharing layer never writes the cache.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.processing_utils import ProcessorMixin

from foveal.engine.models.arch import Architecture, ModelLoadError
from foveal.engine.models.loader import IMAGE_PROCESSOR_FILES, image_processor_settings
from foveal.engine.models.runner import HFRunner, KVLayout

CLASS_NAME = "Gemma4ForConditionalGeneration"
IMAGE_TOKENS = ("image_token", "boi_token", "eoi_token")  # tokenizer attributes the processor reads

GEMMA4 = Architecture(
    "gemma4",
    (CLASS_NAME,),
    processor_class="Gemma4Processor",
    image_token="<|image|>",  # replaced at load by the tokenizer's own image_token
    image_keys=("pixel_values", "image_position_ids"),
    features_as_list=True,  # Gemma4Model concatenates mm_encoder_outputs' pooler_output list
)


# ---- load-time checks ---------------------------------------------------------------------------------------


def check_config(raw: Mapping[str, Any], path: Path) -> None:
    """Refuse a folder this module cannot run, before any weights are read (the message names what is missing)."""
    if not isinstance(raw.get("vision_config"), Mapping):
        raise ModelLoadError(
            f"{path}: config.json of {CLASS_NAME} has no vision_config; foveal runs Gemma 4 on images and text, "
            "save the checkpoint's full config.json (with its vision tower)"
        )
    if raw.get("image_token_id") is None:
        raise ModelLoadError(f"{path}: config.json of {CLASS_NAME} has no image_token_id; save the checkpoint's own")
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise ModelLoadError(f"{path}: config.json of {CLASS_NAME} has no text_config")
    if text.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"{path}: this Gemma 4 checkpoint sets use_bidirectional_attention="
            f"{text['use_bidirectional_attention']!r} (image tokens attend both ways), which foveal's paged "
            "attention does not implement yet; use a checkpoint without it"
        )
    settings = image_processor_settings(path)
    if settings is None:
        raise ModelLoadError(
            f"{path} has no image processor settings ({IMAGE_PROCESSOR_FILES}); save the Gemma 4 image processor with the model"
        )
    kind = settings.get("image_processor_type")
    if kind is None or not kind.startswith("Gemma4ImageProcessor"):
        raise ModelLoadError(
            f"{path}: the image processor settings name image_processor_type {kind!r}; a Gemma 4 folder needs "
            "Gemma4ImageProcessor's config (save the checkpoint's own image processor)"
        )


# ---- the processor (image + text; no audio, no video) -------------------------------------------------------


class Gemma4ImagesOnly(transformers.Gemma4Processor):
    """Gemma4Processor built from its image processor and tokenizer only.

    transformers reads a processor's parts from its `__init__` parameters (`ProcessorMixin.get_attributes`);
    this `__init__` names only the image processor and the tokenizer, so neither the audio feature
    extractor nor the video processor (whose loading needs torchvision) is required. It sets the
    attributes the parent's `__init__` sets for images and skips that `__init__`, which would add a
    video token to the tokenizer (changing its size). The audio token attributes are empty strings:
    the parent's input check reads them even for image-only calls. Placeholder expansion,
    mm_token_type_ids and the chat template are the real class's code.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, image_seq_length: int = 280):
        self.image_seq_length = image_seq_length
        self.image_token_id = tokenizer.image_token_id
        self.image_token, self.boi_token, self.eoi_token = (getattr(tokenizer, n) for n in IMAGE_TOKENS)
        self.audio_token_id, self.audio_token, self.boa_token, self.eoa_token = None, None, "", ""
        ProcessorMixin.__init__(self, image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def load_processor(path: Path) -> tuple[Any, Any]:
    """(hf processor, tokenizer) of a Gemma 4 folder: its image processor and tokenizer under the images-only class."""
    image_processor = Gemma4ImageProcessorPil.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for name in IMAGE_TOKENS:
        token = getattr(tokenizer, name, None)
        if token is None or tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id):
            raise ModelLoadError(
                f"{path}: the tokenizer has no {name} (Gemma 4's image tokens); save the checkpoint's own tokenizer"
            )
    settings = path / "processor_config.json"
    seq = json.loads(settings.read_text()).get("image_seq_length", 280) if settings.is_file() else 280
    processor = Gemma4ImagesOnly(image_processor, tokenizer, tokenizer.chat_template, image_seq_length=seq)
    return processor, tokenizer


def text_only_config(path: Path) -> Any:
    """The folder's Gemma4Config without its audio tower (foveal never feeds audio; its weights stay unread)."""
    config = transformers.Gemma4Config.from_pretrained(path)
    config.audio_config = None
    return config


# ---- the runner -----------------------------------------------------------------------------------------------


def kv_layout(text: Any) -> KVLayout:
    """Gemma 4's KV tensors: one per layer that computes K/V, of its own shape; sharing layers read their
    producer's (the last non-sharing layer of the same attention type, transformers' pairing)."""
    modes, types = text.kv_sharing_modes, text.layer_types
    first_shared = text.num_hidden_layers - text.num_kv_shared_layers
    index: list[int]
    shapes: list[tuple[int, int]]
    index, shared, shapes, windows = [], [], [], []
    for layer in range(text.num_hidden_layers):
        if modes[layer] == "reuse":
            producer = max(i for i in range(first_shared) if types[i] == types[layer])
            index.append(index[producer])
            shared.append(True)
        else:
            layer_config = text.per_layer_config[layer]
            index.append(len(shapes))
            shared.append(False)
            shapes.append((layer_config.num_key_value_heads, layer_config.head_dim))
            windows.append(text.sliding_window if types[layer] == "sliding_attention" else None)
    return KVLayout(tuple(index), tuple(shared), tuple(shapes), tuple(windows))


class Gemma4Runner(HFRunner):
    """HFRunner with Gemma 4's KV layout (see the module docstring); decode traced on CPU like every HFRunner.
    (Its layers are not ones LeanDecoder reproduces, so HFRunner keeps transformers' forward.)"""

    def layout_kv(self, model: torch.nn.Module) -> KVLayout:
        return kv_layout(model.config.get_text_config())  # type: ignore[union-attr, operator]  # nn.Module: Tensor | Module
