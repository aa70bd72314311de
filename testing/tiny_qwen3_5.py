"""A tiny random Qwen3.5 (image-text, hybrid attention) checkpoint, built offline like tiny_qwen.py.

The folder is a Qwen3-VL-style one (Qwen's tokenizer layout and chat template, Qwen2VLImageProcessor
with patch 16 and merge 2: 4 .. 16 image tokens per image) whose text model is Qwen3.5's hybrid
stack: Gated DeltaNet linear-attention layers (conv kernel 4, two key heads and four value heads
of 8) around full-attention layers with M-RoPE (layer kinds: linear, linear, full, linear).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers as tf
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from foveal.engine.models.processor import PromptInputs
from foveal.testing import tiny_qwen

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def build_qwen3_5(folder: Path) -> Path:
    tok = tiny_qwen.train_tokenizer(tiny_qwen.QWEN3_TEMPLATE)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=64 * 64, max_pixels=32 * 32 * 16
    )
    torch.manual_seed(0)
    text = dict(
        tiny_qwen.QWEN_TEXT,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        vocab_size=len(tok),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": tiny_qwen.MROPE_SECTION,
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
        out_hidden_size=tiny_qwen.TEXT["hidden_size"],
        num_position_embeddings=16,
    )
    config = tf.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        architectures=["Qwen3_5ForConditionalGeneration"],
        **tiny_qwen._token_ids(tok),
    )
    return tiny_qwen._save(tf.Qwen3_5ForConditionalGeneration(config), Path(folder), tok, image_processor)


def prompts(loaded: Any) -> list[PromptInputs]:
    """Qwen-VL's parity prompts: images of four sizes (one prompt holds two) and one text-only."""
    return tiny_qwen.prompts(loaded)
