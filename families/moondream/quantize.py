"""int8 / int4 weights for Moondream 2 and 3 on CPU: which of the model's weights are quantized, and how.

PROBLEM
    `foveal.load(folder, quantize="int8" | "int4")` must shrink what a decode step reads, as it does for
    the transformers families (engine/models/quant.py `quantize_model`), but Moondream's module tree is
    foveal's own: quantize_model's transformers hooks (get_decoder, get_output_embeddings) do not exist
    here, and Moondream 3's experts are [E, out, in] stacks, not linears.
SOLUTION
    What the transformers families quantize, on Moondream's text decoder (text.py, text3.py):
      - every block's `attn.qkv`, `attn.proj` and dense `mlp.fc1` / `mlp.fc2`: `QuantLinear`s of `mode`;
      - Moondream 3's expert stacks `mlp.fc1` / `mlp.fc2`: `moe_quant.QuantStack`s of `mode`;
      - `lm_head`: int8 whatever the mode (quantize_model's rule: the head decides every token; it is
        untied from `wte`, whose rows stay in the compute dtype).
    Kept in the compute dtype (bf16 by default under quantize, loader.resolve_options):
      - the MoE router (E rows) and tau's `wq` / `wv` (n_heads rows each): a few rows per layer, far
        under 1 % of the weights, whose outputs make discrete choices (top-k experts) or scale whole
        heads (tau), and int4 needs 16 rows;
      - the vision encoder and its projection, and the region heads: quantize_model leaves vision
        towers and projectors as they are (they run once per image); the region heads read only region
        steps' rows and decide every coordinate and size, and are small.
    `check` raises ValueError for a shape `mode` cannot hold, before anything is read or changed (it
    runs on the meta-device model); `quantize_text` then replaces the layers in place.
INVARIANTS
    - Only `quantize_text` changes modules, and only after `check` passed for all of them.
    - Activations keep the model's dtype; scales are stored in it.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from foveal.engine.models.quant import GROUP_SIZE, QuantLinear, builder, check_int4_shape, quantize_linear

from .layers import MLP
from .moe import MoE
from .moe_quant import COLUMNS, ROWS, QuantStack

MODES = ("int8", "int4")
REFUSED = "quantize={!r} is not supported for Moondream; use None, 'int8' or 'int4' (CPU)"


def _linears(text: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, name, layer) of every block's attention and dense-MLP linears."""
    found = []
    for block in cast(nn.ModuleList, text.blocks):
        parts: list[tuple[nn.Module, tuple[str, ...]]] = [(cast(nn.Module, block.attn), ("qkv", "proj"))]
        if isinstance(block.mlp, MLP):
            parts.append((block.mlp, ("fc1", "fc2")))
        found += [(parent, name, cast(nn.Linear, getattr(parent, name))) for parent, names in parts for name in names]
    return found


def _stacks(text: nn.Module) -> list[tuple[MoE, str, str]]:
    """(moe, name, layout) of every expert stack."""
    moes = [block.mlp for block in cast(nn.ModuleList, text.blocks) if isinstance(block.mlp, MoE)]
    return [(moe, name, layout) for moe in moes for name, layout in (("fc1", ROWS), ("fc2", COLUMNS))]


def check(text: nn.Module, mode: object) -> None:
    """Raise ValueError unless `mode` is "int8" or "int4" and every layer it would quantize suits it."""
    if mode not in MODES:
        raise ValueError(REFUSED.format(mode))
    if mode != "int4":
        return
    for _, _, linear in _linears(text):
        check_int4_shape(linear.out_features, linear.in_features, GROUP_SIZE)
    for moe, name, layout in _stacks(text):
        experts, out, inp = getattr(moe, name).weight.shape
        QuantStack.check(experts, out, inp, mode, layout)


def quantize_text(text: nn.Module, mode: str) -> None:
    """Replace the text decoder's layers by `mode` ones in place (see the module docstring)."""
    check(text, mode)
    dtype = cast(torch.Tensor, text.wte).dtype
    items = [(parent, name, None) for parent, name, _ in _linears(text)] + list(_stacks(text))

    def build(item: tuple) -> nn.Module:
        parent, name, layout = item
        layer = getattr(parent, name)
        if layout is None:
            return quantize_linear(layer, mode, dtype)
        return QuantStack.from_stack(layer.weight, mode, layout, dtype)

    with builder() as pool:
        # each float layer is dropped as soon as its replacement is set: the load never holds both models
        for (parent, name, _), layer in zip(items, pool.map(build, items), strict=True):
            setattr(parent, name, layer)
    head = cast(nn.Linear, text.lm_head)
    text.lm_head = QuantLinear.int8_from_float(head.weight, head.bias, dtype)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (packed codes and scales included)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
