"""A tiny random Molmo 2 checkpoint, built offline like the other tiny families (tiny.py).

The folder looks like a real one: config.json + model.safetensors, a byte-level BPE tokenizer with
Qwen-style chat tokens and Molmo's image tokens (`<im_patch>`, `<im_col>`, `<im_start>`, ...) as
added tokens past the LM head's vocabulary (the checkpoint's extra embedding table holds them, as
in the real ones), a Qwen-style chat template whose image parts are `<|image|>`, and
Molmo2ImageProcessor's preprocessor_config.json (crops of 28 pixels, patch 4, pooling 2 x 2, at
most two crops besides the low-resolution view: an image becomes about 50 image tokens). The
adapter pools the last two vision layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import transformers as tf
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from foveal.engine.models.processor import PromptInputs
from foveal.families.molmo2.model import BLOCK_TOKENS, IMAGE_TOKEN, Molmo2ImagesProcessor
from foveal.testing.tiny_inputs import CORPUS, PROMPTS, TEXT

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IMAGE_TOKENS = [*BLOCK_TOKENS, IMAGE_TOKEN, "<|video|>"]  # added past the base vocabulary
EXTRA_ROWS = 16  # the extra embedding table (>= the image tokens)

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = CORPUS + ['<points coords="1 1 073 160 2 173 600">red circle</points> There are none.'] * 10
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATE,
    )
    fast.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    return fast


def build_molmo2(folder: Path) -> Path:
    tok = train_tokenizer()
    base = len(tok) - len(IMAGE_TOKENS)
    ids = dict(zip(IMAGE_TOKENS, cast(list[int], tok.convert_tokens_to_ids(IMAGE_TOKENS)), strict=True))
    image_processor = Molmo2ImagesProcessor(
        size={"height": 28, "width": 28}, patch_size=4, max_crops=2, overlap_margins=[1, 1], pooling_size=[2, 2]
    )
    torch.manual_seed(0)
    text = dict(
        TEXT,
        vocab_size=base,
        additional_vocab_size=EXTRA_ROWS,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        image_size=[28, 28],
        patch_size=4,
    )
    adapter = dict(
        vision_feature_layer=[-1, -2],
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        text_hidden_size=TEXT["hidden_size"],
    )
    config = tf.Molmo2Config(  # type: ignore[call-arg]  # the token ids are extra attributes its signature omits
        text_config=text,
        vision_config=vision,
        adapter_config=adapter,
        image_start_token_id=ids["<im_start>"],
        low_res_image_start_token_id=ids["<low_res_im_start>"],
        image_end_token_id=ids["<im_end>"],
        image_patch_id=ids["<im_patch>"],
        frame_start_token_id=ids["<frame_start>"],
        frame_end_token_id=ids["<frame_end>"],
        architectures=["Molmo2ForConditionalGeneration"],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    model = tf.Molmo2ForConditionalGeneration(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    settings = folder / "preprocessor_config.json"  # real folders name the transformers class
    data = json.loads(settings.read_text())
    data["image_processor_type"] = "Molmo2ImageProcessor"
    settings.write_text(json.dumps(data, indent=2))
    return Path(folder)


IMAGE_SIZES = [(40, 30), (25, 80), (120, 40)]  # (width, height): tilings 1x2, 2x1, 1x2 of other shapes


def pictures() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in IMAGE_SIZES]


def prompts(loaded: Any) -> list[PromptInputs]:
    """Chat prompts with images of different sizes (the second holds two, text between them) and one
    without an image."""
    images = pictures()

    def turn(text: str, pics: list[Image.Image] | None = None) -> PromptInputs:
        rendered = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return loaded.processor(rendered, pics)

    return [
        turn(IMAGE_TOKEN + PROMPTS[2], [images[0]]),
        turn(IMAGE_TOKEN + PROMPTS[3] + IMAGE_TOKEN + "and here?", [images[1], images[2]]),
        turn(PROMPTS[4]),
    ]
