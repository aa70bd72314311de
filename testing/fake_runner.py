"""A deterministic stand-in for a model, for tests and benchmarks of the engine.

PROBLEM
    The engine's invariants (pipelined == blocking, zombies, page reuse) must be tested without a
    model, and its pipeline measured against a known forward time.
SOLUTION
    `FakeRunner` keeps a real paged "KV cache": each forward writes its query tokens' entries at
    `kv_index` and reads every sequence's context back through `block_tables`. The logits are a
    row of a fixed random table chosen by a hash of that context, a position-weighted sum of the
    tokens, so they depend on the sequence's whole history and nothing else: a wrong page, position
    or gathered input id changes the output. The cache holds each position's term of that sum
    (token and position in, a 31-bit number out), so a forward's work on the whole context is one
    gather and one sum: the fake's own compute is host CPU time a real accelerator would not take
    from the scheduler thread, and it is kept small. `reference_logits(tokens)` computes the same
    without any cache, for checking the engine against a plain loop. The forward then sleeps until
    `delay_s` (+ seeded `jitter_s`) has passed since it began: the sleep stands in for
    accelerator time and releases the GIL, like a real native forward would. On a CUDA device the
    tensors live on the GPU and the delay is a queued GPU spin (`torch.cuda._sleep`), so the host
    returns at once, as it does from a real launch.
    With `window=w` the logits depend on the last w tokens only, so greedy text soon repeats
    itself (a stand-in for copying, which prompt-lookup drafts feed on). With `sliding=True` as
    well it declares runner.SlidingWindow: those w tokens are read from a pool of their own
    through the batch's sliding block tables (engine/sliding.py), so a page released while still
    in the window changes the output (or fails the read).
    Rows of one launch may share pages (runner.SharedPages): every row's entries are written before
    any row reads its context back.
INVARIANTS
    - Logits are a pure function of the sequence's tokens (prompt + generated so far; the last
      `window` of them when set).
    - A forward takes at least `delay_s`; the fake's own work runs inside that time.
"""

from __future__ import annotations

import random
import time

import torch

from foveal.engine.runner import ForwardBatch

_M31 = (1 << 31) - 1


def _term(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each token's term of its context hash: (token + 1) * weight(position), mod 2**31 (int64)."""
    weights = (positions * 0x5BD1E995 + 0x27D4EB2F) & _M31
    return ((tokens + 1) * weights) & _M31


def _mix(terms_sum: torch.Tensor) -> torch.Tensor:
    """The hash of a context from the sum of its terms: reduced mod 2**31, then mixed."""
    h = terms_sum & _M31
    h = (h ^ (h >> 15)) * 0x2C1B3C6D & _M31
    return h ^ (h >> 13)


class FakeRunner:
    rows_share_pages = True  # runner.SharedPages: all entries are written before any context is read

    def __init__(
        self,
        vocab_size: int = 256,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        seed: int = 0,
        table_rows: int = 4096,
        boost: dict[int, float] | None = None,
        device: str | torch.device = "cpu",
        window: int | None = None,
        sliding: bool = False,
    ) -> None:
        if sliding and window is None:
            raise ValueError("sliding=True needs a window")
        self.vocab_size = vocab_size
        self.window = window
        self.sliding_window = window if sliding else None  # runner.SlidingWindow
        self.sliding_ids: torch.Tensor | None = None
        self.device = torch.device(device)
        self.max_positions: int | None = None
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self._jitter = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        table = torch.randn(table_rows, vocab_size, generator=gen) * 3.0
        for token, logit in (boost or {}).items():  # e.g. make EOS likely in some contexts
            table[:, token] += logit
        self.table = table.to(self.device)
        self.kv: torch.Tensor | None = None
        self.page_size = 0
        self.forwards = 0
        self._cycles_per_s = _gpu_cycles_per_s(self.device) if self.device.type == "cuda" else 0.0

    def kv_bytes_per_token(self) -> int:
        return 8

    def sliding_kv_bytes_per_token(self) -> int:
        return 8 if self.sliding_window else 0

    def allocate_kv(self, num_pages: int, page_size: int, sliding_pages: int | None = None) -> None:
        self.kv = torch.full((num_pages * page_size,), -1, dtype=torch.int64, device=self.device)
        self.ids = torch.full_like(self.kv, -1)  # the token at each position (for `window`)
        if sliding_pages is not None:  # the window's tokens, in their own pool
            self.sliding_ids = torch.full((sliding_pages * page_size,), -1, dtype=torch.int64, device=self.device)
        self.page_size = page_size

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        start, ps = time.perf_counter(), self.page_size
        assert self.kv is not None, "allocate_kv first"
        self.kv.index_copy_(0, batch.kv_index, _term(batch.input_ids, batch.positions))
        self.ids.index_copy_(0, batch.kv_index, batch.input_ids)
        tables, lens, id_cache = batch.block_tables, batch.context_lens.long(), self.ids
        if batch.sliding_block_tables is not None:
            assert self.sliding_ids is not None, "allocate_kv(sliding_pages=...) first"
            assert batch.sliding_kv_index is not None  # set with sliding_block_tables
            self.sliding_ids.index_copy_(0, batch.sliding_kv_index, batch.input_ids)
            tables, id_cache = batch.sliding_block_tables, self.sliding_ids
        offsets = torch.arange(tables.shape[1] * ps, device=self.device)
        valid = offsets[None, :] < lens[:, None]
        slots = tables.long().repeat_interleave(ps, dim=1) * ps + offsets % ps
        if self.window is None:
            terms = self.kv.index_select(0, torch.where(valid, slots, 0).view(-1)).view(slots.shape)
        else:  # the last `window` tokens, weighted by their place in the window
            first = (lens - self.window).clamp(min=0)[:, None]
            valid &= offsets[None, :] >= first
            ids = id_cache.index_select(0, torch.where(valid, slots, 0).view(-1)).view(slots.shape)
            terms = _term(ids, offsets[None, :] - first)
        rows = _mix(torch.where(valid, terms, 0).sum(dim=1)) % self.table.shape[0]
        logits = self.table.index_select(0, rows)
        self.forwards += 1
        delay = self.delay_s + (self._jitter.uniform(0, self.jitter_s) if self.jitter_s else 0.0)
        if self.device.type == "cuda":  # keep the GPU busy, not the host: a queued spin kernel
            if delay > 0:
                torch.cuda._sleep(int(delay * self._cycles_per_s))
        elif (left := delay - (time.perf_counter() - start)) > 0:
            time.sleep(left)
        return logits

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        """The logits `forward` gives after a sequence of `tokens`, computed without any cache."""
        if self.window is not None:
            tokens = tokens[-self.window :]
        t = torch.tensor(tokens, device=self.device)
        terms = _term(t, torch.arange(len(tokens), device=self.device))
        return self.table[_mix(terms.sum()) % self.table.shape[0]]


def _gpu_cycles_per_s(device: torch.device) -> float:
    """Calibrate torch.cuda._sleep (a spin of N GPU cycles) against wall time with CUDA events."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000_000)  # warm up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / (start.elapsed_time(end) / 1e3)
