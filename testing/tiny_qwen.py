"""Tiny random Qwen2.5-VL and Qwen3-VL checkpoints, built offline like the other tiny families (tiny.py).

A folder looks like a real one: config.json + model.safetensors, a byte-level BPE tokenizer with
Qwen's special tokens (`<|im_start|>`, `<|vision_start|>`, `<|image_pad|>`, ...) and a Qwen-style
chat template, and preprocessor_config.json of transformers' `Qwen2VLImageProcessor` (both families
use it: patch 14 for Qwen2.5-VL, 16 for Qwen3-VL). The tokenizer splits digits one by one, as
Qwen's own does. The model is small enough that several images fit a test in milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from foveal.engine.models.processor import PromptInputs
from foveal.testing.tiny_inputs import CORPUS, PROMPTS, TEXT

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN_CORPUS = (
    CORPUS
    + [
        '```json\n[\n\t{"bbox_2d": [12, 345, 678, 901], "label": "red circle"}\n]\n```',
        '{"point_2d": [12, 34], "label": "blue square"}',
        "user assistant system You are a helpful assistant.",
    ]
    * 10
)

# Qwen2.5-VL's template writes a default system turn; Qwen3-VL's does not. Image parts become
# <|vision_start|><|image_pad|><|vision_end|>, which the processor expands to the image's tokens.
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
)
_TURNS = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + _CONTENT + "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_5_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}" + _TURNS
)
QWEN3_TEMPLATE = _TURNS


def train_tokenizer(chat_template: str, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Qwen's special tokens; digits split one by one (Qwen's pre-tokenizer does); no BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(QWEN_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


def _token_ids(tok) -> dict:
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("vision_start", "vision_end")}
    return dict(
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
    )


def _save(model, folder: Path, tok, image_processor) -> Path:
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    # Real folders name their processor classes; foveal builds only the image + text part (qwen_vl.py).
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["image_processor_type"] = "Qwen2VLImageProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    return folder


# The text model: head_dim 16, so the rotary half (8 frequencies) splits into t/h/w sections 2/3/3.
QWEN_TEXT = {**TEXT, "head_dim": 16, "max_position_embeddings": 1024}
MROPE_SECTION = [2, 3, 3]


def build_qwen2_5_vl(folder: Path) -> Path:
    tok = train_tokenizer(QWEN2_5_TEMPLATE)
    # factor 28 (patch 14 x merge 2): 4 .. 16 image tokens per image
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56, max_pixels=28 * 28 * 16
    )
    torch.manual_seed(0)
    text = dict(
        QWEN_TEXT,
        vocab_size=len(tok),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION},
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,  # 2 x 2 merged tokens per window, so windowed and full attention both run
        fullatt_block_indexes=[1],
        out_hidden_size=TEXT["hidden_size"],
    )
    config = tf.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        **_token_ids(tok),
    )
    return _save(tf.Qwen2_5_VLForConditionalGeneration(config), folder, tok, image_processor)


def build_qwen3_vl(folder: Path) -> Path:
    tok = train_tokenizer(QWEN3_TEMPLATE)
    # factor 32 (patch 16 x merge 2): 4 .. 16 image tokens per image
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=64 * 64, max_pixels=32 * 32 * 16
    )
    torch.manual_seed(0)
    text = dict(
        QWEN_TEXT,
        vocab_size=len(tok),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": MROPE_SECTION,
            "mrope_interleaved": True,
        },
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=TEXT["hidden_size"],
        num_position_embeddings=16,  # a 4 x 4 grid of learned positions, interpolated per image
        deepstack_visual_indexes=[0, 1],  # features of both vision layers are added to decoder layers 0, 1
    )
    config = tf.Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        architectures=["Qwen3VLForConditionalGeneration"],
        **_token_ids(tok),
    )
    return _save(tf.Qwen3VLForConditionalGeneration(config), folder, tok, image_processor)


FAMILIES = ("qwen2_5_vl", "qwen3_vl")


# (width, height): five sizes whose resized grids all differ, in both families (14 and 16 pixel patches)
IMAGE_SIZES = [(40, 30), (64, 64), (25, 80), (120, 40), (130, 90)]


def prompts(loaded: Any) -> list[PromptInputs]:
    """Chat prompts with images of different sizes (the third prompt holds two) and one without an image."""
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in IMAGE_SIZES]
    turn = lambda text: loaded.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    one = "<|vision_start|><|image_pad|><|vision_end|>"
    return [
        loaded.processor(turn(one + PROMPTS[2]), pictures[0]),
        loaded.processor(turn(one + PROMPTS[0]), pictures[1]),
        loaded.processor(turn(one + PROMPTS[3] + one + "and here?"), [pictures[2], pictures[3]]),
        loaded.processor(turn(one + PROMPTS[4]), pictures[4]),
        loaded.processor(turn(PROMPTS[1])),
    ]
