"""A tiny random Gemma 4 (image-text) checkpoint, built offline like the other tiny families (tiny.py).

The folder looks like a real one: config.json + model.safetensors, a byte-level BPE tokenizer with
Gemma 4's control tokens (`<|turn>`, `<turn|>`, `<|image|>`, `<|image>`, `<image|>`, audio's) named
as the real tokenizer names them (image_token, boi_token, eoi_token, ...), a Gemma 4-style chat
template, and Gemma4ImageProcessor's preprocessor_config.json. The config exercises every special
part of the decoder: sliding layers with a window of 8 positions (shorter than every prompt),
full-attention layers with their own head size and KV head count, per-layer input embeddings, and
KV sharing (the last two layers read earlier layers' K/V). Every image becomes about 60 soft tokens:
the processor resizes it to fill its budget (70 soft tokens, the smallest it allows; patch 4 and
pooling 2, so a soft token is 8 x 8 pixels of the resized image), its aspect ratio kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from foveal.engine.models.processor import PromptInputs
from foveal.testing.tiny_inputs import CORPUS, PROMPTS, TEXT

NAMED = {  # the tokenizer's named special tokens, as Gemma 4's tokenizer_config.json names them
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", *NAMED.values()]

# Gemma 4's turn format: <|turn>role\n ... <turn|>\n, the assistant's role is "model".
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)

WINDOW = 8  # positions a sliding layer sees: fewer than any prompt's
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
SHARED_LAYERS = 2  # the last two layers read the K/V of layers 2 (sliding) and 1 (full)


def train_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS + ['{"objects": [{"x_min": 0.25, "y_min": 0.5}]} user model'] * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens=NAMED,
        chat_template=TEMPLATE,
    )


def config(tok: Any, **text_overrides: Any) -> tf.Gemma4Config:
    text = dict(
        TEXT,
        vocab_size=len(tok),
        num_hidden_layers=len(LAYER_TYPES),
        head_dim=16,
        global_head_dim=32,  # full layers: another head size ...
        num_global_key_value_heads=1,  # ... and KV head count (read where attention_k_eq_v is set)
        attention_k_eq_v=True,
        layer_types=LAYER_TYPES,
        sliding_window=WINDOW,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=len(tok),
        num_kv_shared_layers=SHARED_LAYERS,
        final_logit_softcapping=30.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<turn|>")],
    )
    text.update(text_overrides)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=256,
    )
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in NAMED.items()}
    return tf.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        audio_token_id=ids["audio_token"],
        video_token_id=tok.unk_token_id,
        architectures=["Gemma4ForConditionalGeneration"],
    )


def build_gemma4(folder: Path) -> Path:
    tok = train_tokenizer()
    # patch 4, pooling 2: an image of w x h pixels becomes at most (w / 8) * (h / 8) soft tokens
    image_processor = Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    torch.manual_seed(0)
    model = tf.Gemma4ForConditionalGeneration(config(tok))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    return Path(folder)


# (width, height): three sizes whose soft-token grids differ
IMAGE_SIZES = [(40, 30), (25, 80), (120, 40)]


def pictures() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in IMAGE_SIZES]


def prompts(loaded: Any) -> list[PromptInputs]:
    """Chat prompts with images of different sizes (the third holds two) and one without an image."""
    images = pictures()
    image = loaded.tokenizer.image_token

    def turn(text: str, pics: list[Image.Image] | None = None) -> PromptInputs:
        rendered = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return loaded.processor(rendered, pics, add_special_tokens=False)

    return [
        turn(image + PROMPTS[2], [images[0]]),
        turn(image + PROMPTS[3] + image + "and here?", [images[1], images[2]]),
        turn(PROMPTS[4]),
    ]
