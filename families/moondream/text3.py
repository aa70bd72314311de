"""Moondream 3's text decoder on foveal's paged KV cache: tau attention and a mixture of experts.

PROBLEM
    Moondream 3 keeps Moondream 2's parallel block (h = ln(x); x = x + attn(h) + mlp(h)), its fused
    [q | k | v] projection, partial rotary (dims 0..31 of each 64-dim head, dim i with i + 16) and
    its attention pattern (BOS + image prefix bidirectional, then causal), but changes three things:
    the attention's q and v are scaled per head by "tau" factors, the rotary base is 1.5e6, and the
    MLP of every layer from `moe.start_layer` on is a mixture of experts (moe.py).
SOLUTION
    Tau, per layer: t = gelu(qkv) over the whole qkv row (the exact GELU of the preview code, or its
    tanh approximation by `text.tau_gelu`, config.py); tok_q = tanh(t wq^T), tok_v = tanh(t wv^T),
    one value per head; tau_pos = 1 + (sigmoid(alpha * ln(p + 1)) - 0.5) with p the absolute
    position, in the model dtype; q_h *= tok_q[h] + tau_pos[h], v_h *= tok_v[h] + tau_pos[h]; k is
    unchanged. Then rotary on q and k (text.apply_rotary, whose half layout gives the same scores as
    the reference's interleaved one), and attention on the engine's paged KV exactly as Moondream 2's
    (text.py): the scaled v is what the cache holds. Dense layers (below `moe.start_layer`) keep
    Moondream 2's tanh-GELU MLP. Tokens with a fine-tune's adapter take their MLPs with its change of
    weights, dense and per expert (lora.py); the others keep the block's output.
INVARIANTS
    - The module tree's `state_dict()` keys are the real checkpoint's (`attn.tau.wq`, `mlp.router`, ...).
    - `forward` returns hidden states before `post_ln`, as Moondream 2's (the region heads read those).
    - A decode launch uses only the MoE's static strategies, so it traces (moe.py).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from foveal.engine.models.attention import PagedContext, paged_attention

from .config import HEAD_DIM, LN_EPS, TextConfig
from .layers import MLP, QKV
from .lora import AdapterRows, AdapterStacks, adapted_feed_forward
from .moe import MoE
from .text import apply_rotary


class Tau(nn.Module):
    """Per-head rows over the whole qkv output (`wq`, `wv`) and the position slope `alpha`."""

    def __init__(self, n_heads: int, qkv_dim: int, **factory) -> None:
        super().__init__()
        self.wq = nn.Parameter(torch.empty(n_heads, qkv_dim, **factory))
        self.wv = nn.Parameter(torch.empty(n_heads, qkv_dim, **factory))
        self.alpha = nn.Parameter(torch.empty(n_heads, **factory))

    def factors(
        self, qkv: torch.Tensor, log_pos: torch.Tensor, approximate: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, heads, 1] scale of q, [T, heads, 1] scale of v); `log_pos` [T, 1] is log(position + 1),
        the same in every layer of a launch."""
        t = F.gelu(qkv, approximate=approximate)
        tok_q, tok_v = torch.tanh(t @ self.wq.T), torch.tanh(t @ self.wv.T)
        tau_pos = 1 + (torch.sigmoid(self.alpha[None] * log_pos) - 0.5)
        return (tok_q + tau_pos)[..., None], (tok_v + tau_pos)[..., None]


class TauAttention(QKV):
    def __init__(self, dim: int, n_heads: int, qkv_dim: int, **factory) -> None:
        super().__init__(dim, qkv_dim, **factory)
        self.tau = Tau(n_heads, qkv_dim, **factory)


class TextBlock3(nn.Module):
    def __init__(self, cfg: TextConfig, index: int, **factory) -> None:
        super().__init__()
        assert cfg.moe is not None  # config.check: every Moondream 3 config has one
        qkv_dim = (cfg.n_heads + 2 * cfg.n_kv_heads) * HEAD_DIM
        self.ln = nn.LayerNorm(cfg.dim, eps=LN_EPS, **factory)
        self.attn = TauAttention(cfg.dim, cfg.n_heads, qkv_dim, **factory)
        self.is_moe = index >= cfg.moe.start_layer
        self.mlp: nn.Module = MoE(cfg.dim, cfg.moe, **factory) if self.is_moe else MLP(cfg.dim, cfg.ff_dim, **factory)

    def feed_forward(self, h: torch.Tensor, decode: bool) -> torch.Tensor:
        return self.mlp(h, decode) if self.is_moe else self.mlp(h)


class TextDecoder3(nn.Module):
    def __init__(self, cfg: TextConfig, **factory) -> None:
        super().__init__()
        self.cfg = cfg
        self.approximate = "tanh" if cfg.tau_gelu == "tanh" else "none"
        self.wte = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim, **factory))
        self.blocks = nn.ModuleList(TextBlock3(cfg, i, **factory) for i in range(cfg.n_layers))
        self.post_ln = nn.LayerNorm(cfg.dim, eps=LN_EPS, **factory)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, **factory)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx: PagedContext,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        lora: tuple[AdapterStacks, AdapterRows] | None = None,
    ) -> torch.Tensor:
        """x [T, dim] input embeddings -> [T, dim] hidden states (before post_ln), as text.TextDecoder's."""
        # `lora`: (AdapterStacks, AdapterRows) of lora.py where the launch holds adapters, else None
        cos, sin = cos_table[positions], sin_table[positions]
        log_pos = torch.log(positions.to(x.dtype) + 1)[:, None]  # the tau position term's, once per launch
        heads = self.cfg.n_heads
        num_tokens = x.shape[0]
        decode = ctx.query_seq is None  # build_context leaves it None for decode-only launches
        for index, module in enumerate(self.blocks):
            block = cast(TextBlock3, module)
            h = block.ln(x)
            qkv = block.attn.qkv(h)
            q, k, v = (part.view(num_tokens, heads, HEAD_DIM) for part in qkv.chunk(3, dim=-1))
            scale_q, scale_v = block.attn.tau.factors(qkv, log_pos, self.approximate)
            q, k = apply_rotary(q * scale_q, cos, sin), apply_rotary(k, cos, sin)
            a = paged_attention(ctx, index, q, k, v * scale_v, None)
            attn = block.attn.proj(a.reshape(num_tokens, heads * HEAD_DIM))
            mlp = block.feed_forward(h, decode)
            if lora is not None:  # adapted tokens take their adapter's MLP (lora.py); the others keep mlp
                mlp = adapted_feed_forward(block, index, h, mlp, *lora)
            x = x + attn + mlp
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.post_ln(hidden))
