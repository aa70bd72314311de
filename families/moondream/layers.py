"""The two building blocks Moondream's encoder, decoder and region heads share: an MLP and a fused-QKV attention's weights.

Module and attribute names are the real checkpoint's (`mlp.fc1`, `attn.qkv`, `attn.proj`), so that a
model's `state_dict()` keys are exactly the tensor names in `model.safetensors`.
GELU is the tanh approximation everywhere (the reference uses it in every MLP; the exact GELU
differs by about 1e-3 in the fixture, 10x its tolerance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int, out: int | None = None, **factory) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, inner, **factory)
        self.fc2 = nn.Linear(inner, dim if out is None else out, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class QKV(nn.Module):
    """Weights of one attention layer: fused q|k|v projection and the output projection."""

    def __init__(self, dim: int, qkv_out: int, **factory) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, qkv_out, **factory)
        self.proj = nn.Linear(dim, dim, **factory)
