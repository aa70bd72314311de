"""Moondream's text decoder on foveal's paged KV cache.

PROBLEM
    The reference decodes one sequence with its own dense KV cache and a 2048-wide mask. The engine
    needs flat batches of sequences (prefill and decode rows mixed) whose K/V live in its page pool,
    with Moondream's attention pattern: the BOS + image prefix (positions 0..729) attends
    bidirectionally, every later position causally; a text-only prompt is causal from 0.
SOLUTION
    Blocks are parallel: h = ln(x); x = x + proj(attn(h)) + fc2(gelu(fc1(h))). Q/K/V come from one
    fused projection ([q | k | v]); rotary is partial (dims 0..31 of each 64-dim head) with half
    pairing (dim i rotates with dim i + 16), angles from a float32 table as the reference builds it.
    A LoRA variant per token (lora.py) adds its delta to qkv, proj, fc1 and fc2.
    Attention reuses the engine's paged layout (`attention.PagedKV`) and the per-launch indices and
    mask of `attention.build_context`: new K/V are written at the batch's `kv_index`, each sequence's
    keys gathered through its block table, one SDPA call over the padded query block; the image
    prefix is `build_context`'s bidirectional prefix (`PrefillInputs.prefix_len` = 730).
INVARIANTS
    - Only K/V rows named by `kv_index` are written (attention.py's invariants hold unchanged).
    - `forward` returns the final hidden states before `post_ln` (the region heads read those);
      `logits` applies post_ln and lm_head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foveal.engine.models.attention import PagedContext, paged_attention

from .config import HEAD_DIM, LN_EPS, ROPE_THETA, ROTARY_DIM, TextConfig
from .layers import MLP, QKV
from .lora import Stacks, delta


def rotary_table(max_positions: int, theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, 16] in float32, built as the reference does (complex exp of t * freq)."""
    freqs = 1.0 / (
        theta ** (torch.arange(0, ROTARY_DIM, 2, dtype=torch.float32)[: ROTARY_DIM // 2] / ROTARY_DIM)
    )
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * freqs[None, :]
    rotation = torch.exp(1j * angles)
    return rotation.real.contiguous(), rotation.imag.contiguous()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, 64]; cos/sin [T, 16]. Dims 0..15 pair with 16..31 (halves); 32..63 pass through.

    The reference writes the rotated pairs interleaved; this keeps them in halves. The same
    permutation of q and k dims leaves every attention score unchanged (only raw K caches differ)."""
    half = ROTARY_DIM // 2
    real, imag, rest = x[..., :half].float(), x[..., half:ROTARY_DIM].float(), x[..., ROTARY_DIM:]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([real * c - imag * s, real * s + imag * c], dim=-1).to(x.dtype)
    return torch.cat([rotated, rest], dim=-1)


class TextBlock(nn.Module):
    def __init__(self, cfg: TextConfig, **factory) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.dim, eps=LN_EPS, **factory)
        self.attn = QKV(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * HEAD_DIM, **factory)
        self.mlp = MLP(cfg.dim, cfg.ff_dim, **factory)


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextConfig, **factory) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim, **factory))
        self.blocks = nn.ModuleList(TextBlock(cfg, **factory) for _ in range(cfg.n_layers))
        self.post_ln = nn.LayerNorm(cfg.dim, eps=LN_EPS, **factory)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, **factory)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ctx: PagedContext,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        lora: tuple[Stacks, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [T, dim] input embeddings of the launch's tokens -> [T, dim] hidden states (before post_ln).

        `lora`: the variants' stacks and the [T, R] selector of each token's variant (lora.py); None:
        the base model."""
        cos, sin = cos_table[positions], sin_table[positions]
        heads, kv_heads = self.cfg.n_heads, self.cfg.n_kv_heads
        num_tokens = x.shape[0]
        for index, block in enumerate(self.blocks):
            h = block.ln(x)
            qkv = block.attn.qkv(h)
            if lora is not None:
                qkv = qkv + delta(lora[0], (index, "qkv"), h, lora[1])
            q, k, v = qkv.split(
                [heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=-1
            )
            q = apply_rotary(q.view(num_tokens, heads, HEAD_DIM), cos, sin)
            k = apply_rotary(k.view(num_tokens, kv_heads, HEAD_DIM), cos, sin)
            a = paged_attention(ctx, index, q, k, v.view(num_tokens, kv_heads, HEAD_DIM), None)
            attn = block.attn.proj(a.reshape(num_tokens, heads * HEAD_DIM))
            if lora is None:
                x = x + attn + block.mlp(h)
                continue
            stacks, select = lora
            attn = attn + delta(stacks, (index, "proj"), h, select)  # reads h, as the reference's
            g = F.gelu(block.mlp.fc1(h) + delta(stacks, (index, "fc1"), h, select), approximate="tanh")
            x = x + attn + block.mlp.fc2(g) + delta(stacks, (index, "fc2"), g, select)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.post_ln(hidden))

