"""Paged attention for transformers' decoder layers: the one piece of the forward foveal writes itself.

PROBLEM
    transformers' decoder layers compute Q/K/V and RoPE exactly as the reference does, but they keep
    K/V in their own per-request caches. The engine needs K/V in *its* paged pool (pages owned by
    the engine's bookkeeping, tensors owned by the runner) and one flat batch of sequences that mix
    prefill chunks and decode tokens.

SOLUTION
    transformers resolves each layer's attention function by name from `config._attn_implementation`
    through its `AttentionInterface`. We register `ATTN_NAME` there (`hf_attention`, called by the
    loaders that hand the name to transformers: importing transformers' modeling code costs seconds,
    which a GGUF text model, run by lean.py without it, need not pay). For a decoder layer tagged
    with a KV index (`module.foveal_kv_index`), the function writes the layer's new K/V at the
    batch's `kv_index`, gathers each sequence's pages through `block_tables`, and runs one SDPA
    call over the padded [num_seqs, max_query_len] query block with a boolean mask built once per
    forward (`PagedContext`). Untagged modules (vision towers) use transformers' own SDPA.
    A layer that attends over a sliding window (transformers passes its `sliding_window`) gets the
    same mask with the keys at or before `position - window` masked out, built once per window per
    forward. A layer that reads another layer's K/V (KV sharing: `module.foveal_kv_shared`, its
    `foveal_kv_index` the producer's) writes nothing and attends over the producer's pages. The KV
    tensors of sliding layers may live in a page pool of their own (`PagedKV.sliding`,
    engine/sliding.py), which keeps only each sequence's window: they are written and gathered
    through the batch's sliding block tables, whose passed pages read the scratch page (masked).

INVARIANTS
    - Only the KV rows named in `kv_index` are written; only pages named in `block_tables` (and the
      scratch page, where the table is padded with -1) are read.
    - A query at position p sees keys 0..p of its own sequence (causal within the query), plus the
      whole prefix [0, prefix_len) when the family has prefix attention (PaliGemma's image + prompt);
      so a PaliGemma prompt must be prefilled in one launch (the engine does not split prompts).
    - A sliding layer's query at position p sees keys p - window + 1 .. p of its own sequence, as
      transformers' `sliding_window_overlay` does (the window counts the query's own position).
    - With `blocks` (build_context), a block token sees every block token of its sequence in the
      launch, before or after it; everything else stays causal.
    - Padded query rows always see key 0, so SDPA never produces NaN rows (they are dropped anyway).
    - No host synchronisation: every index is derived on the device from the batch tensors.
    - A traced decode step reads no shape in a layer (head counts are ints, the key count -1) and
      converts no tensor to the dtype it has: each would be a dispatch in every replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from foveal.engine.runner import ForwardBatch

ATTN_NAME = "foveal_paged"


@dataclass(slots=True)
class PagedKV:
    """The runner's KV tensors: per layer, [num_pages * page_size, kv_heads, head_dim] for K and for V."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int
    scratch_page: int  # one page past the engine's: block-table padding and padding rows point here
    # the tensors of sliding-window layers kept in a pool of their own (engine/sliding.py), its
    # window and its scratch page; empty when every tensor is in the main pool
    sliding: frozenset[int] = frozenset()
    window: int | None = None
    sliding_scratch_page: int = -1


@dataclass(slots=True)
class PagedContext:
    """Per-forward indices shared by all layers (built once, read by every layer's attention)."""

    kv: PagedKV
    kv_index: torch.Tensor  # [T] where each query token's K/V goes
    gather_index: torch.Tensor  # [B * L] KV row of each key position of each sequence (clamped), flat
    query_seq: torch.Tensor | None  # [T] the sequence of each query token (None: a decode launch, token i is sequence i)
    query_row: torch.Tensor | None  # [T] its row in the padded query block (None: decode, always row 0)
    mask: torch.Tensor  # [B, 1, Q, L] additive float mask in the compute dtype: 0 = may attend, -inf = not
    num_seqs: int
    max_query_len: int
    num_keys: int  # L
    query_pos: torch.Tensor | None = None  # [B, Q] each query row's position (decode: [B, 1]); for windows
    # window (None: full attention) -> its mask, and its GQA-folded form (CPU), built once per forward
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    grouped_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # the same two indices in the sliding-window pool (None: no tensor is there)
    sliding_kv_index: torch.Tensor | None = None
    sliding_gather_index: torch.Tensor | None = None

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The additive mask of a layer with a sliding `window` (None: `mask`), built on first use."""
        if window is None:
            return self.mask
        mask = self.window_masks.get(window)
        if mask is None:
            assert self.query_pos is not None  # set for runners with windows
            key_pos = torch.arange(self.num_keys, device=self.mask.device)
            far = key_pos[None, None, :] <= self.query_pos[:, :, None] - window  # [B, Q, L]
            mask = self.mask.masked_fill(far[:, None], float("-inf"))
            self.window_masks[window] = mask
        return mask


_NUMPY_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero KV tensor. On CPU the memory comes from numpy's calloc: the kernel maps zero pages
    and faults them in on first write, where torch.zeros writes every byte up front (for a long
    cache, a tenth of a GGUF load: docs/performance.md). The zeros
    matter: a masked key position still multiplies its V row by weight 0, and 0 * NaN is NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=_NUMPY_OF_WIDTH[dtype.itemsize])).view(dtype)


def prefix_lens(batch: ForwardBatch, device: torch.device) -> torch.Tensor | None:
    """Per sequence, its bidirectional prefix length (`PrefillInputs.prefix_len`; 0 for sequences
    without prefill inputs: in decode their prefix is cached); None when the launch prefills nothing."""
    if batch.is_decode or not batch.prefill:
        return None
    lens = [0 if p is None else p.prefix_len for p in batch.prefill]
    return torch.tensor(lens, dtype=torch.int64).to(device, non_blocking=True)


def build_context(
    batch: ForwardBatch,
    kv: PagedKV,
    prefix_lens: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
    blocks: torch.Tensor | None = None,
) -> PagedContext:
    """Derive the gather indices and the attention mask of one launch (device ops only).

    `blocks`: [T] bool, the query tokens of one bidirectional block per sequence (Molmo-style image
    tokens: each sees every other block token of its sequence in the launch, later ones too); None:
    causal (and the prefix, where `prefix_lens` gives one).

    The mask is additive and in the compute dtype so that no layer converts a boolean mask again
    (SDPA turns a bool mask into a float one on every call). A decode launch (one query token per
    sequence) needs neither the padded query block's indices nor the causal part of the mask.
    """
    device = batch.input_ids.device
    # A Python int, also under the tracer (a graph serves one rows bucket): a count read from a shape
    # is a traced value there, whose every use in a layer costs an item() per replay
    num_seqs, max_q = int(batch.num_seqs), batch.max_query_len
    pages = -(-batch.max_context_len // kv.page_size)
    gather_index = _gather_index(batch.block_tables, pages, kv.page_size, kv.scratch_page)
    sliding_gather = None
    if kv.sliding:
        if batch.sliding_block_tables is None:
            raise ValueError("this runner keeps sliding-window K/V in a pool of its own: the batch needs its tables")
        sliding_gather = _gather_index(batch.sliding_block_tables, pages, kv.page_size, kv.sliding_scratch_page)
    num_keys = pages * kv.page_size
    key_pos = torch.arange(num_keys, device=device)
    in_context = key_pos[None, None, :] < batch.context_lens.to(torch.int64)[:, None, None]  # [B, 1, L]
    query_seq = query_row = None
    if max_q == 1 and prefix_lens is None and blocks is None and not batch.prefill:  # prefill: rows by query_seq
        visible = in_context
        query_pos = (batch.context_lens.to(torch.int64) - 1)[:, None]
    else:
        num_tokens = batch.input_ids.shape[0]
        token = torch.arange(num_tokens, device=device)
        query_seq = torch.searchsorted(batch.query_start[1:].to(torch.int64), token, right=True)
        query_row = token - batch.query_start.to(torch.int64)[query_seq]
        query_pos = torch.zeros(num_seqs, max_q, dtype=torch.int64, device=device)
        query_pos[query_seq, query_row] = batch.positions
        real_row = torch.zeros(num_seqs, max_q, dtype=torch.bool, device=device)
        real_row[query_seq, query_row] = True
        visible = key_pos[None, None, :] <= query_pos[:, :, None]
        if prefix_lens is not None:
            visible |= key_pos[None, None, :] < prefix_lens.to(device)[:, None, None]
        if blocks is not None:  # a block's tokens are all in this launch (prompts with images are not split)
            query_block = torch.zeros(num_seqs, max_q, dtype=torch.bool, device=device)
            query_block[query_seq, query_row] = blocks
            key_block = torch.zeros(num_seqs, num_keys, dtype=torch.bool, device=device)
            key_block[query_seq, batch.positions] = blocks
            visible |= query_block[:, :, None] & key_block[:, None, :]
        visible &= in_context
        visible[:, :, 0] |= ~real_row  # padded query rows: keep SDPA finite
    mask = torch.zeros_like(visible, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return PagedContext(
        kv=kv,
        kv_index=batch.kv_index,
        gather_index=gather_index,
        query_seq=query_seq,
        query_row=query_row,
        mask=mask[:, None],
        num_seqs=num_seqs,
        max_query_len=max_q,
        num_keys=num_keys,
        query_pos=query_pos,
        sliding_kv_index=batch.sliding_kv_index if kv.sliding else None,
        sliding_gather_index=sliding_gather,
    )


def _gather_index(block_tables: torch.Tensor, pages: int, page_size: int, scratch_page: int) -> torch.Tensor:
    """[B * pages * page_size] the KV row of each key position of each sequence; -1 entries read the scratch page."""
    table = block_tables[:, :pages].to(torch.int64)
    table = torch.where(table < 0, scratch_page, table)
    offsets = torch.arange(page_size, device=block_tables.device)
    return (table[:, :, None] * page_size + offsets).reshape(-1)


def paged_attention(
    ctx: PagedContext,
    index: int,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    scaling: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """One layer's attention over the paged cache: query [T, H, D], key/value [T, Hkv, D] -> [T, H, D].

    Writes the launch's K/V at `ctx.kv_index` first (key None: a layer reading another layer's K/V,
    written by that layer), then attends over each sequence's gathered pages; `window`: a sliding
    window's length in positions (None: full attention).
    """
    k_cache, v_cache = ctx.kv.k[index], ctx.kv.v[index]
    kv_index, gather_index = ctx.kv_index, ctx.gather_index
    if index in ctx.kv.sliding:  # its own pool, which keeps only the window's pages
        assert ctx.kv.window is not None  # a sliding pool has its window
        if window is None or window > ctx.kv.window:
            raise ValueError(
                f"KV tensor {index} keeps a window of {ctx.kv.window} positions; a layer with window {window} "
                "cannot read it (the runner's KV layout pairs layers and windows wrongly)"
            )
        # set with a sliding pool
        assert ctx.sliding_kv_index is not None and ctx.sliding_gather_index is not None
        kv_index, gather_index = ctx.sliding_kv_index, ctx.sliding_gather_index
    if key is not None:
        assert value is not None  # given with the key
        k_cache.index_copy_(0, kv_index, _as(key, k_cache.dtype))
        v_cache.index_copy_(0, kv_index, _as(value, v_cache.dtype))
    mask = ctx.mask_for(window)

    # index_select over the flat KV rows, not k_cache[gather_index]: same rows, faster on CPU
    # (advanced indexing takes a generic path; docs/performance.md has the figures). The
    # head counts are Python ints (int() of a traced shape is a constant of the graph) and the key
    # count is -1: a traced key count would cost an item() per use in every replay.
    num_seqs, kv_heads, dim, heads = ctx.num_seqs, int(k_cache.shape[1]), int(k_cache.shape[2]), int(query.shape[1])
    gathered = (num_seqs, -1, kv_heads, dim)
    keys = _as(k_cache.index_select(0, gather_index).view(gathered).transpose(1, 2), query.dtype)  # [B, Hkv, L, D]
    values = _as(v_cache.index_select(0, gather_index).view(gathered).transpose(1, 2), query.dtype)
    if ctx.query_seq is None:
        # Decode: sequence i's one query is token i. The query heads that share a KV head become that
        # head's query rows ([B, Hkv, H / Hkv, D]), so GQA needs no repeated K/V and no padding.
        rows = query.reshape(num_seqs, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scaling)
        return out.reshape(num_seqs, heads, dim)
    padded = query.new_zeros(num_seqs, ctx.max_query_len, heads, dim)
    padded[ctx.query_seq, ctx.query_row] = query
    if heads > kv_heads and query.device.type == "cpu":  # measured on CPU only; CUDA keeps enable_gqa
        return _grouped_attention(ctx, padded, keys, values, scaling, window)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys,
        values,
        attn_mask=mask,
        scale=scaling,
        enable_gqa=heads > kv_heads,
    )
    return out.transpose(1, 2)[ctx.query_seq, ctx.query_row]


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`, with no op where it is already: `to()` returns the tensor itself then, but a
    trace still records the call, a dispatch in every replay (four a layer)."""
    return t if t.dtype == dtype else t.to(dtype)


def _grouped_attention(
    ctx: PagedContext,
    padded: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """The padded query block [B, Q, H, D] over keys/values [B, Hkv, L, D], GQA folded into query
    rows as in decode: the G query heads of a KV head are G * Q rows of that head, with the mask
    repeated per head (built once per launch, on the first layer). On CPU, SDPA's `enable_gqa`
    repeats K/V per query head, which costs about twice the folded form for launches of a few
    query tokens per sequence (and the same for a prefill)."""
    num_seqs, max_q, heads, dim = padded.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    grouped = ctx.grouped_masks.get(window)
    if grouped is None:
        shape = (num_seqs, 1, group, max_q, ctx.num_keys)
        grouped = ctx.mask_for(window)[:, :, None].expand(shape).reshape(num_seqs, 1, group * max_q, ctx.num_keys)
        ctx.grouped_masks[window] = grouped
    rows = padded.view(num_seqs, max_q, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    out = F.scaled_dot_product_attention(
        rows.reshape(num_seqs, kv_heads, group * max_q, dim), keys, values, attn_mask=grouped, scale=scaling
    )
    out = out.view(num_seqs, kv_heads, group, max_q, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, max_q, heads, dim)[ctx.query_seq, ctx.query_row]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    ctx: PagedContext | None = kwargs.get("foveal_context")
    index = getattr(module, "foveal_kv_index", None)
    if ctx is None or index is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(
            "attention logit soft-capping (Gemma 2) is not supported by foveal's runner"
        )
    shared = getattr(module, "foveal_kv_shared", False)  # K/V written by the producer layer
    out = paged_attention(
        ctx,
        index,
        query[0].transpose(0, 1),
        None if shared else key[0].transpose(0, 1),
        None if shared else value[0].transpose(0, 1),
        scaling,
        kwargs.get("sliding_window"),
    )
    return out[None], None


def hf_attention() -> str:
    """`ATTN_NAME`, registered with transformers' `AttentionInterface` (registering again is a dict
    update): what a loader passes as a transformers model's attention implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    return ATTN_NAME
