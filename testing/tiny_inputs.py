"""What every tiny checkpoint builder shares (tiny.py and the tiny_*.py of the other families): the
corpus their tokenizers are trained on, the text model's sizes, and the prompts and images the
checks feed them. A module of its own so that the builders import it, not each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

CORPUS = [
    "a red circle left of a blue square",
    "describe the image in one sentence",
    "how many shapes are there? answer with a number",
    "the quick brown fox jumps over the lazy dog",
    "detect every green triangle and give its box",
    "point at the yellow star near the top right corner",
] * 20

PROMPTS = [
    "a",
    "red circle",
    "describe the image in one sentence",
    "how many shapes are there? answer with a number please",
    "the quick brown fox jumps over the lazy dog and a blue square detect every green triangle",
]

TEXT: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # peaked logits: greedy ties would make token equality a coin toss
)


def images(n: int = 5) -> list[Image.Image]:
    """Deterministic images of different sizes and aspect ratios."""
    rng = np.random.default_rng(0)
    sizes = [(40, 30), (64, 64), (25, 80), (90, 45), (33, 33), (50, 70)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes[:n]]
