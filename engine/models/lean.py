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
    [T, hidden] batch: one fused `rms_norm` per norm, rotary as `x * cos + roll(x) * sin_signed`
    with cos/sin built once per forward by the model's own rotary module, the paged attention of
    `attention.py` called directly (its decode path needs no padding and no repeated K/V), and the
    modules' own projections (nn.Linear or foveal's QuantLinear, whatever the loader put there;
    int4 q/k/v and gate/up run as one launch each, `quant.fuse_int4`). The
    logits of each sequence's last token are taken before the final norm and the head. Launches
    with images go through transformers' forward (the family's own merge of image features).

INVARIANTS
    - Same logits as transformers' forward with foveal's paged attention, up to float rounding
      (fp32 parity of every family in tests/models/test_parity.py goes through this path for text
      launches and every decode launch).
    - Weights are shared with the transformers model, never copied (the Gemma norm's 1 + w is the one
      derived vector, a few KB a layer; fused int4 projections hold the codes once, the model's
      layers reading views of them).
    - Layers of any other shape are refused by `LeanDecoder.supports` (the runner then keeps
      transformers' forward for every launch; `HFRunner.lean is None` says so).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foveal.engine.models.attention import PagedContext, paged_attention
from foveal.engine.models.quant import fuse_int4

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
    )

    def __init__(self, layer: nn.Module, gemma: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = _norm_weight(layer.input_layernorm, gemma)
        self.post_norm = _norm_weight(layer.post_attention_layernorm, gemma)
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.gate, self.up, self.down, self.act = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.scaling: float = attn.scaling
        self.qkv = self.gate_up = None  # one int4 launch each where the layers allow it (LeanDecoder)


def _norm_weight(norm: nn.Module, gemma: bool) -> torch.Tensor:
    # Gemma scales by (1 + w) in float32, Llama by w; both normalise in float32 first.
    return (1.0 + norm.weight.float()).to(norm.weight.dtype) if gemma else norm.weight


class LeanDecoder:
    """The decoder stack of a Llama- or Gemma-style text model, called with the runner's flat batch."""

    def __init__(self, model: nn.Module, fuse: bool = True) -> None:
        decoder = model.get_decoder()
        text = model.config.get_text_config()
        gemma = type(decoder.layers[0]).__name__.startswith("Gemma")
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.layers = [_Layer(layer, gemma) for layer in decoder.layers]
        if fuse:  # q/k/v and gate/up as one int4 launch each (quant.fuse_int4), all layers at once
            groups = [
                group
                for layer in self.layers
                for group in ([layer.q, layer.k, layer.v], [layer.gate, layer.up])
            ]
            fused = iter(fuse_int4(groups))
            for layer in self.layers:
                layer.qkv, layer.gate_up = next(fused), next(fused)
        self.final_norm = _norm_weight(decoder.norm, gemma)
        self.eps: float = text.rms_norm_eps
        self.head = model.get_output_embeddings()
        self.heads: int = text.num_attention_heads
        self.kv_heads: int = text.num_key_value_heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Whether every decoder layer is one this forward reproduces (and nothing it skips is set)."""
        try:
            decoder = model.get_decoder()
            layers = list(decoder.layers)
        except AttributeError:
            return False
        text = model.config.get_text_config()
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
        half = self.head_dim // 2
        cos = cos[0].unsqueeze(1)  # [T, 1, D]
        sin = sin[0]
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).unsqueeze(1)  # rotate_half's signs
        width = self.heads * self.head_dim
        shape = (x.shape[-1],)
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, shape, layer.input_norm, self.eps)
            q, k, v = layer.qkv(h) if layer.qkv is not None else (layer.q(h), layer.k(h), layer.v(h))
            # -1, not the token count: a count read from a shape is a traced value, its arithmetic
            # a few nodes per use in every replay
            q = q.view(-1, self.heads, self.head_dim)
            k = k.view(-1, self.kv_heads, self.head_dim)
            v = v.view(-1, self.kv_heads, self.head_dim)
            q = q * cos + q.roll(half, -1) * sin
            k = k * cos + k.roll(half, -1) * sin
            attn = paged_attention(ctx, index, q, k, v, layer.scaling)
            x = x + layer.o(attn.reshape(-1, width))
            h = F.rms_norm(x, shape, layer.post_norm, self.eps)
            gate, up = layer.gate_up(h) if layer.gate_up is not None else (layer.gate(h), layer.up(h))
            x = x + layer.down(layer.act(gate) * up)
        if last is not None:
            x = x[last]
        x = F.rms_norm(x, shape, self.final_norm, self.eps)
        return self.head(x).float()
