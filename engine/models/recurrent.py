"""Recurrent state beside the paged KV: linear-attention layers (Gated DeltaNet) on the engine's flat batches.

PROBLEM
    A hybrid decoder (full-attention layers between linear-attention ones) keeps, per sequence and
    per linear layer, a causal-convolution state (the last kernel - 1 inputs) and a recurrent
    state ([value heads, key dim, value dim]) instead of K/V. transformers' layer runs one padded
    batch with its own cache; the engine's launches are flat: sequences one after another in one
    [1, T] row, mixing prefill chunks, decode tokens and jump-forward runs, and a sequence's
    state must live from its first launch to its release, whatever launches carry it.
SOLUTION
    `RecurrentStates` holds the states in tensors with one row per KV page: row P is the state after
    the last token written into page P so far. A sequence's running state is the row of the page
    holding its latest token; a launch splits each sequence's tokens at page boundaries and runs
    each piece from the row of the page before it (zeros at position 0) into its own page's row.
    So every full page's row is a *snapshot* of the state at that page boundary, and it never
    changes again (later tokens go to later pages). That makes the prefix cache work as for K/V: a
    request that shares the cached pages 0..k-1 (same tokens and images, by the page chain's hash)
    starts from the snapshot in page k-1's row, exactly the state those tokens leave. And the
    state's lifecycle is the pages': taken at admission, released exactly once after the last step
    in flight (a zombie writes only its own page's row), a reused page's row overwritten by its new
    owner before anyone reads it (a registered page is full, so only read).
    `paged_linear_attention` replaces the layer's forward: the projections run on the whole flat
    batch; the convolution and the delta rule run per piece (transformers' own kernels: the chunked
    rule for several tokens, the recurrent rule for one token after a state, as its generate does),
    all of a decode launch's sequences at once.
INVARIANTS (tests/models/test_qwen3_5.py)
    - A sequence's state after a launch is that of all its tokens so far, in order, however its
      tokens were split into launches (prefill chunks, decode, jump-forward runs) or came from the
      prefix cache.
    - Only rows of pages the launch writes K/V into are written; rows of full pages are only read.
    - Memory: one state per page (the price of snapshots at every page boundary; counted in the
      runner's bytes per token). The bookkeeping reads the launch's query starts, positions and
      block tables on the host: free on CPU, a synchronisation per launch on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class Piece:
    """Tokens [start, end) of the flat batch, all in one KV page: run from row `source` (None: zero
    states, position 0) into row `target` (their page's)."""

    start: int
    end: int
    source: int | None
    target: int


@dataclass(slots=True)
class Launch:
    """One launch's pieces as the linear layers need them (host values, read once per launch)."""

    pieces: list[Piece]
    decode: bool  # one token per sequence, each after a state: one batched piece per sequence
    # a decode launch's source and target rows as device tensors, made once for all its layers
    sources: torch.Tensor | None = None
    targets: torch.Tensor | None = None


class RecurrentStates:
    """Conv and recurrent states of every linear layer, one row per KV page (module docstring)."""

    def __init__(
        self, layers: dict[int, Any], rows: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.page_size = page_size
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}
        for index, module in layers.items():
            kernel = module.conv_kernel_size
            self.conv[index] = torch.zeros(rows, module.conv_dim, kernel - 1, dtype=dtype, device=device)
            shape = (rows, module.num_v_heads, module.head_k_dim, module.head_v_dim)
            self.state[index] = torch.zeros(shape, dtype=torch.float32, device=device)  # the rule's own dtype

    def launch(self, batch: Any) -> Launch:
        """The launch's tokens cut at page boundaries, each piece with the rows it reads and writes."""
        size = self.page_size
        starts = batch.query_start.tolist()
        firsts = batch.positions[batch.query_start[:-1].to(torch.int64)].tolist()
        tables = batch.block_tables.tolist()
        pieces = []
        for seq, first in enumerate(firsts):
            at, position, end = starts[seq], first, starts[seq + 1]
            while at < end:
                length = min(end - at, size - position % size)
                source = tables[seq][(position - 1) // size] if position else None
                pieces.append(Piece(at, at + length, source, tables[seq][position // size]))
                at, position = at + length, position + length
        decode = batch.is_decode and all(p.source is not None for p in pieces)
        if not decode:
            return Launch(pieces, False)
        device = batch.block_tables.device
        sources = torch.tensor([p.source for p in pieces], dtype=torch.int64, device=device)
        targets = torch.tensor([p.target for p in pieces], dtype=torch.int64, device=device)
        return Launch(pieces, True, sources, targets)

    @staticmethod
    def bytes_per_row(layers: dict[int, Any], dtype: torch.dtype) -> int:
        total = 0
        for module in layers.values():
            total += module.conv_dim * (module.conv_kernel_size - 1) * dtype.itemsize
            total += module.num_v_heads * module.head_k_dim * module.head_v_dim * 4
        return total


def paged_linear_attention(
    module: Any, hidden_states: torch.Tensor, launch: Launch, states: RecurrentStates, kernels: Any
) -> torch.Tensor:
    """A Gated DeltaNet layer (transformers' `Qwen3_5GatedDeltaNet`'s weights) on a flat [1, T, hidden]
    launch, each piece from its source row into its page's row. `kernels`: the model's modeling module
    (its `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`, what its layer calls)."""
    x = hidden_states[0]
    num_tokens = x.shape[0]
    mixed = module.in_proj_qkv(x)  # [T, conv_dim]
    z = module.in_proj_z(x).reshape(num_tokens, -1, module.head_v_dim)
    beta = module.in_proj_b(x).sigmoid()
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(x).float() + module.dt_bias)
    layer = module.layer_idx
    conv, state = states.conv[layer], states.state[layer]
    weight = module.conv1d.weight  # [conv_dim, 1, kernel]
    if launch.decode:
        source, target = launch.sources, launch.targets
        assert source is not None and target is not None  # a decode launch has them
        window = torch.cat([conv.index_select(0, source), mixed[:, :, None].to(conv.dtype)], dim=-1)
        out = F.silu(F.conv1d(window.to(weight.dtype), weight, module.conv1d.bias, groups=module.conv_dim))
        q, k, v = _split(module, out.transpose(1, 2))  # [B, 1, heads, dim]
        core, last = kernels.torch_recurrent_gated_delta_rule(
            q, k, v, g=g[:, None], beta=beta[:, None], initial_state=state.index_select(0, source),
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        conv.index_copy_(0, target, window[:, :, 1:])
        state.index_copy_(0, target, last.to(state.dtype))
        core = core[:, 0]
    else:
        parts = []
        for piece in launch.pieces:
            start, end, fresh = piece.start, piece.end, piece.source is None
            before = torch.zeros_like(conv[0]) if fresh else conv[piece.source]
            window = torch.cat([before, mixed[start:end].T.to(conv.dtype)], dim=-1)[None]  # [1, C, K-1+L]
            out = F.silu(F.conv1d(window.to(weight.dtype), weight, module.conv1d.bias, groups=module.conv_dim))
            q, k, v = _split(module, out.transpose(1, 2))  # [1, L, heads, dim]
            rule = kernels.torch_chunk_gated_delta_rule
            if end - start == 1 and not fresh:  # one token after a state: the rule generate decodes with
                rule = kernels.torch_recurrent_gated_delta_rule
            core, last = rule(
                q, k, v, g=g[None, start:end], beta=beta[None, start:end],
                initial_state=None if piece.source is None else state[piece.source : piece.source + 1],
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )
            conv[piece.target] = window[0, :, window.shape[-1] - conv.shape[-1] :]
            state[piece.target] = last[0].to(state.dtype)
            parts.append(core[0])
        core = torch.cat(parts)
    core = module.norm(core.reshape(-1, module.head_v_dim).to(z.dtype), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, num_tokens, -1))


def _split(module: Any, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, L, conv_dim] -> query, key [B, L, key heads, key dim], value [B, L, value heads, value dim]."""
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    batch, length = mixed.shape[:2]
    return (
        query.reshape(batch, length, -1, module.head_k_dim),
        key.reshape(batch, length, -1, module.head_k_dim),
        value.reshape(batch, length, -1, module.head_v_dim),
    )
