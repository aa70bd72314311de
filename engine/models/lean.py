"""`LeanDecoder`: the text decoder's forward written flat, over transformers' own modules and weights.

PROBLEM
    At batch 1 a decode step of a small model spends most of its forward outside its matmuls: in
    the number of small ops the traced
    transformers forward replays per layer (RMSNorm as six ops, rotary as seven per tensor, the
    transposes around attention, the padded query block and boolean-mask conversion in every layer),
    each a dispatch of a few microseconds, about 2,000 of them a step.

SOLUTION
    For decoder layers of a known shape (`SUPPORTED_LAYERS`: Llama's and Gemma's, which covers the
    text models of every family foveal supports) this module runs the stack itself on the flat
    [T, hidden] batch: RMSNorm as six plain ops in float32 (`_Norm`: torch's `rms_norm` runs as a
    composite of more, and converts dtypes both ways), rotary as `addcmul(x * cos, roll(x),
    sin_signed)` (`_Rotary`), applied to q and k as one tensor where the fused q/k/v launch returns
    them side by side, with cos/sin built once per forward by the model's own rotary module, the
    paged attention of `attention.py` called directly (its decode path needs no padding and no
    repeated K/V), and the modules' own projections (nn.Linear or foveal's QuantLinear, whatever
    the loader put there; int4 q/k/v and gate/up run as one launch each, `quant.fuse_int4`; an int4
    projection's bf16 output is added into the float32 residual as it is, `SplitLinear.add_to`).
    Shapes are Python ints from the config, never read from a tensor: under the tracer a shape is a
    traced value, each use of it an item() in every replay. The logits of each sequence's last
    token are taken before the final norm and the head. Launches with images go through
    transformers' forward (the family's own merge of image features).

INVARIANTS
    - Same logits as transformers' forward with foveal's paged attention, up to float rounding
      (fp32 parity of every family in tests/models/test_parity.py goes through this path for text
      launches and every decode launch).
    - Weights are shared with the transformers model, never copied (the norms' weights scaled by
      sqrt(hidden), and Gemma's 1 + w, are the derived vectors, a few KB a layer; fused int4
      projections hold the codes once, the model's layers reading views of them).
    - A row's result does not depend on the other rows of its launch in any op of this module
      (norms and rotary are row-wise, elementwise where they are not reductions): speculative
      decoding's verify launches rely on it (docs/speculative.md), and so does the equality of the
      fused and separate projections' logits (q and k rotated together or apart).
    - Layers of any other shape are refused by `LeanDecoder.supports` (the runner then keeps
      transformers' forward for every launch; `HFRunner.lean is None` says so).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from foveal.engine.models.attention import PagedContext, paged_attention
from foveal.engine.models.quant import FusedInt4, SplitLinear, fuse_int4

SUPPORTED_LAYERS = ("LlamaDecoderLayer", "GemmaDecoderLayer")


class _Layer:
    """What one decoder layer's forward reads, resolved once."""

    __slots__ = (
        "input_norm",
        "post_norm",
        "q",
        "k",
        "v",
        "o",
        "gate",
        "up",
        "down",
        "act",
        "scaling",
        "qkv",
        "gate_up",
        "o_add",
        "down_add",
    )

    qkv: FusedInt4 | None
    gate_up: FusedInt4 | None

    def __init__(self, layer: nn.Module, gemma: bool, eps: float) -> None:
        attn: Any  # transformers' modules (nn.Module types their attributes Tensor | Module)
        mlp: Any
        attn, mlp = layer.self_attn, layer.mlp
        # (the norms too: Tensor | Module to mypy)
        self.input_norm = _Norm(_norm_weight(layer.input_layernorm, gemma), eps)  # type: ignore[arg-type]
        self.post_norm = _Norm(_norm_weight(layer.post_attention_layernorm, gemma), eps)  # type: ignore[arg-type]
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.gate, self.up, self.down, self.act = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.scaling: float = attn.scaling
        self.qkv = self.gate_up = None  # one int4 launch each where the layers allow it (LeanDecoder)
        # residual + projection(h), the int4 kernel's bf16 output added as it is where it has one
        self.o_add = _adder(self.o)
        self.down_add = _adder(self.down)


def _adder(linear: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(residual, x) -> residual + linear(x)."""
    if isinstance(linear, SplitLinear):
        return linear.add_to
    return lambda residual, x: residual + linear(x)


def _norm_weight(norm: nn.Module, gemma: bool) -> torch.Tensor:
    # Gemma scales by (1 + w) in float32, Llama by w; both normalise in float32 first.
    weight = cast(torch.Tensor, norm.weight)  # a parameter (nn.Module types its attributes Tensor | Module)
    return (1.0 + weight.float()).to(weight.dtype) if gemma else weight


class _Norm:
    """One RMSNorm: x * rsqrt(mean(x^2) + eps) * w over the last dimension.

    On float32 activations it runs as x * rsqrt(sum(x^2) + n * eps) * (sqrt(n) * w), six ops, the
    same value up to float32 rounding: `F.rms_norm` is a composite of more here (pow, mean as sum
    and div, rsqrt, two muls, and dtype conversions there and back), each a dispatch of a traced
    replay, 61 norms a step of a 30-layer model. Other dtypes keep `F.rms_norm`, which normalises
    in float32 (the plain ops would reduce in bf16)."""

    __slots__ = ("weight", "eps", "size", "scaled")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps
        self.size: int = weight.shape[0]
        self.scaled = weight.float() * math.sqrt(self.size) if weight.dtype == torch.float32 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled is None or x.dtype != torch.float32:
            return F.rms_norm(x, (self.size,), self.weight, self.eps)
        return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + self.size * self.eps) * self.scaled


class _Rotary:
    """RoPE at one forward's positions: x * cos + rotate_half(x) * sin for x [T, heads, head_dim], as
    addcmul(x * cos, roll(x), sin_signed), three elementwise ops (transformers' form is seven).
    Elementwise, so a row's result is the same whatever the other rows and heads of the tensor: q
    and k may rotate as one tensor where they lie side by side (the fused q/k/v launch's output)."""

    __slots__ = ("cos", "sin", "half")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
        half = head_dim // 2  # from the config: a traced shape would be a traced value
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # rotate_half's signs
        self.half, self.cos, self.sin = half, cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * self.cos, x.roll(self.half, -1), self.sin)


class LeanDecoder:
    """The decoder stack of a Llama- or Gemma-style text model, called with the runner's flat batch."""

    def __init__(self, model: nn.Module, fuse: bool = True) -> None:
        # a transformers model: its decoder, config and heads (nn.Module types its attributes Tensor | Module)
        decoder = model.get_decoder()  # type: ignore[operator]
        text = model.config.get_text_config()  # type: ignore[union-attr, operator]
        gemma = type(decoder.layers[0]).__name__.startswith("Gemma")
        self.eps: float = text.rms_norm_eps
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.layers = [_Layer(layer, gemma, self.eps) for layer in decoder.layers]
        if fuse:  # q/k/v and gate/up as one int4 launch each (quant.fuse_int4), all layers at once
            groups = [
                group
                for layer in self.layers
                for group in ([layer.q, layer.k, layer.v], [layer.gate, layer.up])
            ]
            fused = iter(fuse_int4(groups))
            for layer in self.layers:
                layer.qkv, layer.gate_up = next(fused), next(fused)
        self.final_norm = _Norm(_norm_weight(decoder.norm, gemma), self.eps)
        self.head = model.get_output_embeddings()  # type: ignore[operator]
        self.heads: int = text.num_attention_heads
        self.kv_heads: int = text.num_key_value_heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether every decoder layer is one this forward reproduces (and nothing it skips is set)."""
        try:
            decoder = model.get_decoder()  # type: ignore[operator]  # (as in __init__)
            layers = list(decoder.layers)
        except AttributeError:
            return False
        text = model.config.get_text_config()  # type: ignore[union-attr, operator]
        if getattr(text, "final_logit_softcapping", None) or getattr(text, "attn_logit_softcapping", None):
            return False
        return (
            bool(layers)
            and all(type(layer).__name__ in SUPPORTED_LAYERS for layer in layers)
            and all(hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "norm"))
        )

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor | None, ctx: PagedContext
    ) -> torch.Tensor:
        """input_ids, positions [T] -> float32 logits [B, vocab] of the rows `last` (None: every row)."""
        x = self.embed(input_ids)
        cos, sin = self.rotary(x, positions[None])
        rotate = _Rotary(cos[0], sin[0], self.head_dim)
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        width, kv_width = heads * dim, kv_heads * dim
        for index, layer in enumerate(self.layers):
            h = layer.input_norm(x)
            # -1, not the token count: a count read from a shape is a traced value, its arithmetic
            # a few nodes per use in every replay
            joined = layer.qkv.joined(h) if layer.qkv is not None else None
            if joined is not None:  # q and k side by side: one rotary for both
                qk, v = joined.split([width + kv_width, kv_width], dim=-1)
                q, k = rotate(qk.view(-1, heads + kv_heads, dim)).split([heads, kv_heads], dim=1)
            else:  # separate projections (a FusedInt4 beyond its int4 rows runs these same parts)
                q, k, v = layer.q(h), layer.k(h), layer.v(h)
                q, k = rotate(q.view(-1, heads, dim)), rotate(k.view(-1, kv_heads, dim))
            v = v.view(-1, kv_heads, dim)
            attn = paged_attention(ctx, index, q, k, v, layer.scaling)
            x = layer.o_add(x, attn.reshape(-1, width))
            h = layer.post_norm(x)
            gate, up = layer.gate_up(h) if layer.gate_up is not None else (layer.gate(h), layer.up(h))
            x = layer.down_add(x, layer.act(gate) * up)
        if last is not None:
            x = x[last]
        logits = self.head(self.final_norm(x))
        return logits if logits.dtype == torch.float32 else logits.float()
