"""Batched sampling of one step: grammar bitmask, greedy / temperature / top-k / top-p, seeded noise.

PROBLEM
    Seeded sampling must give a request the same tokens whatever else shares its batch and whether
    the engine is pipelined or blocking; and the whole step must be a few batched tensor ops on the
    device, queued behind the forward, never a loop over requests on the host.
SOLUTION
    Gumbel-max sampling with counter-based noise: the noise of token v for a request's k-th output
    token is a hash of (seed, k, v), computed for all rows at once. argmax(logits / T + gumbel) is
    an exact sample from softmax(logits / T) (restricted by top-k / top-p), and it depends only on
    the request's own row. The logits are tempered as (logits - row max) / T, the same distribution,
    so no positive float32 temperature overflows them (`_tempered`). Greedy rows (T = 0) take the argmax. The grammar's bitmask is unpacked
    and applied to the constrained rows in one masked fill.
    When a row asks for logprobs, the step also writes every row's log-probability of its sampled
    id and the top alternatives, from the distribution each row was drawn from (masked; greedy rows
    at temperature 1; random rows tempered and filtered), into the slot's logprob buffers.
INVARIANTS
    - A row's sampled id depends only on its logits, its sampling parameters, its mask and (seed, k).
    - Disallowed tokens are never sampled while the mask allows at least one token, whatever top_p
      (even one float32 holds as 0) and temperature (even one whose logits / temperature overflow).
    - Recording logprobs never changes a sampled id (it reads the distributions after the ids are drawn).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_M32 = 0xFFFFFFFF
UNIFORM_BITS = 23  # see uniform_from_bits


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters of one step, all on the device; index tensors name rows of the step."""

    temperature: torch.Tensor  # [n] float32
    top_p: torch.Tensor  # [n] float32
    top_k: torch.Tensor  # [n] int64, 0 = off
    seeds: torch.Tensor  # [n] int64: a 64-bit seed's bits (request.seed_as_int64)
    counters: torch.Tensor  # [n] int64, index of the output token being sampled
    random_rows: torch.Tensor | None  # [r] int64 rows with temperature > 0, or None if all greedy
    filter_rows: bool  # some random row uses top-k or top-p
    bitmask: torch.Tensor | None  # [c, W] int32 masks of the constrained rows, or None
    mask_rows: torch.Tensor | None  # [c] int64 rows the bitmask rows belong to
    top_logprobs: int = -1  # alternatives to record per row (-1: no row asked for logprobs)


@dataclass(slots=True)
class LogprobBuffers:
    """Where a step's logprobs go: [B] the sampled ids' logprobs, [B, K] the top alternatives."""

    chosen: torch.Tensor  # [B] float32
    top_values: torch.Tensor  # [B, K] float32
    top_ids: torch.Tensor  # [B, K] int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values < 2**32 (constants < 2**31: no overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def seed_key(seeds: torch.Tensor) -> torch.Tensor:
    """A 32-bit key from all 64 bits of each seed: mix32(low ^ mix32(high)).

    mix32 is a bijection with mix32(0) = 0, so seeds below 2**32 keep the key they always had, and
    seeds that differ only in their high half (s and s + 2**32) get different keys.
    """
    high = (seeds >> 32) & _M32  # arithmetic shift, masked: the high half of the unsigned seed
    return _mix32((seeds & _M32) ^ _mix32(high))


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, V] standard Gumbel noise, a pure function of (seed, counter, token id)."""
    key = _mix32(seed_key(seeds) ^ (counters & _M32))
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32((key[:, None] ^ _mix32(tokens)[None, :]) & _M32) >> (32 - UNIFORM_BITS)
    return -torch.log(-torch.log(uniform_from_bits(bits)))


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Map integers in [0, 2**UNIFORM_BITS) to float32 values strictly inside (0, 1).

    (b + 0.5) / 2**23 needs 24 significant bits at most, so float32 holds it exactly and the
    largest value is 1 - 2**-24 < 1. With 24 bits the largest value would round to 1.0, the
    noise to +inf, and a masked logit (-inf + inf = NaN) could win the argmax.
    """
    return (bits.float() + 0.5) / float(1 << UNIFORM_BITS)


def _byte_penalties(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: row b holds 0 where bit i of byte b is set (allowed) and -inf where it is clear."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1
    table = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))
    return table.to(device)


_PENALTIES: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Add -inf to logits[rows[i], v] where bit v of bitmask[i] is clear (allowed logits stay unchanged).

    The bitmask's bytes index a 256-entry table of penalties (little-endian bit order, as llguidance
    writes it), so the whole step is one gather and one indexed add, on any device and with no
    compilation, several times faster on CPU than unpacking the bits with shifts or a boolean
    masked_fill (docs/performance.md gives the figures).
    """
    table = _PENALTIES.get(logits.device)
    if table is None:
        table = _PENALTIES.setdefault(logits.device, _byte_penalties(logits.device))
    n, vocab = bitmask.shape[0], logits.shape[1]
    penalty = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), table).view(n, -1)
    logits.index_add_(0, rows, penalty[:, :vocab])


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Logits with -inf outside each row's top-k and top-p nucleus (the best token always stays).

    The best token is kept by rank, not by the nucleus test: a top_p that float32 rounds to 0 (1e-46)
    passes no token through `mass before < top_p`, nor does a row whose tempered logits overflowed to
    inf (softmax is NaN there); either row would sample from all -inf, i.e. token 0, allowed or not.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[1])
    probs = sorted_logits.softmax(dim=-1)
    nucleus = (probs.cumsum(dim=-1) - probs) < top_p[:, None]
    keep = (rank[None, :] == 0) | ((rank[None, :] < k[:, None]) & nucleus)
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, out: torch.Tensor, logprobs: LogprobBuffers | None = None
) -> None:
    """Write the step's sampled ids into `out[:n]` (int64, on the device), and their logprobs into
    `logprobs` when `batch.top_logprobs >= 0`."""
    logits = logits.float()
    if batch.bitmask is not None:
        assert batch.mask_rows is not None  # set with the bitmask
        apply_bitmask(logits, batch.bitmask, batch.mask_rows)
    ids = argmax_rows(logits)
    scaled = None
    if batch.random_rows is not None:
        rows = batch.random_rows
        scaled = _tempered(logits[rows], batch.temperature[rows, None])
        if batch.filter_rows:
            scaled = filter_top_k_top_p(scaled, batch.top_k[rows], batch.top_p[rows])
        noise = gumbel_noise(batch.seeds[rows], batch.counters[rows], logits.shape[1])
        ids[rows] = argmax_rows(scaled + noise)
    out[: ids.shape[0]].copy_(ids)
    if batch.top_logprobs >= 0 and logprobs is not None:
        record_logprobs(logits, scaled, batch, ids, logprobs)


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value (int64). On CPU through numpy, whose argmax of a
    vocabulary row takes a tenth of torch's time (the first maximum in both, NaN counting as one)."""
    if values.device.type == "cpu":
        return torch.from_numpy(argmax_host(values.contiguous().numpy()))
    return values.argmax(dim=-1)


def argmax_host(values: np.ndarray) -> np.ndarray:
    """`argmax_rows` of a host array."""
    return values.argmax(axis=-1).astype(np.int64, copy=False)


def _tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(logits - row max) / temperature: the same distribution and the same Gumbel argmax as
    logits / temperature (a row's constant shift), but finite for any positive float32 temperature.

    Divided unshifted, a tiny temperature (a subnormal such as 1e-40) sends every positive logit to
    +inf: the best token ties with the rest, and softmax over the infs is NaN. Shifted, the best
    logit is 0 and every other one is negative, so an overflow goes to -inf: only the best token is
    left, the limit of sampling as the temperature goes to 0. A row whose logits are all -inf (no
    allowed token) is shifted by 0, so it stays all -inf rather than NaN.
    """
    top = logits.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return (logits - top) / temperature


def record_logprobs(
    logits: torch.Tensor,
    scaled: torch.Tensor | None,
    batch: SamplingBatch,
    ids: torch.Tensor,
    buffers: LogprobBuffers,
) -> None:
    """Log-softmax of the distribution each row was drawn from; the sampled ids' entries and the top k."""
    logp = logits.log_softmax(dim=-1)  # masked logits: greedy rows sample from these at temperature 1
    if scaled is not None:
        logp[batch.random_rows] = scaled.log_softmax(dim=-1)
    n = ids.shape[0]
    buffers.chosen[:n].copy_(logp.gather(1, ids[:, None])[:, 0])
    k = batch.top_logprobs
    if k:
        values, top_ids = logp.topk(k, dim=-1)
        buffers.top_values[:n, :k].copy_(values)
        buffers.top_ids[:n, :k].copy_(top_ids)
