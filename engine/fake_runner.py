"""A deterministic stand-in for a model, for tests and benchmarks of the engine.

PROBLEM
    The engine's invariants (pipelined == blocking, zombies, page reuse) must be tested without a
    model, and its pipeline measured against a known forward time.
SOLUTION
    `FakeRunner` keeps a real paged "KV cache" that stores token ids: each forward writes its
    query tokens at `slot_mapping` and reads every sequence's context back through
    `block_tables`. The logits are a row of a fixed random table chosen by a hash of that context,
    so they depend on the sequence's whole history and nothing else: a wrong page, position or
    gathered input id changes the output. `reference_logits(tokens)` computes the same without any
    cache, for checking the engine against a plain loop. The forward then sleeps until
    `delay_s` (+ seeded `jitter_s`) has passed since it began: the sleep stands in for
    accelerator time and releases the GIL, like a real native forward would. On a CUDA device the
    tensors live on the GPU and the delay is a queued GPU spin (`torch.cuda._sleep`), so the host
    returns at once, as it does from a real launch.
INVARIANTS
    - Logits are a pure function of the sequence's tokens (prompt + generated so far).
    - A forward takes at least `delay_s`; the fake's own work runs inside that time.
"""

from __future__ import annotations

import random
import time

import torch

from .runner import ForwardBatch

_M31 = (1 << 31) - 1


def _context_hash(tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B] hash of each row's valid tokens: a position-weighted sum, then mixed (int64 arithmetic)."""
    weights = (
        torch.arange(tokens.shape[1], dtype=torch.int64, device=tokens.device) * 0x5BD1E995 + 0x27D4EB2F
    ) & _M31
    h = (((tokens + 1) * weights) * valid).sum(dim=1) & _M31
    h = (h ^ (h >> 15)) * 0x2C1B3C6D & _M31
    return h ^ (h >> 13)


class FakeRunner:
    def __init__(
        self,
        vocab_size: int = 256,
        delay_s: float = 0.0,
        jitter_s: float = 0.0,
        seed: int = 0,
        table_rows: int = 4096,
        boost: dict[int, float] | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
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

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        self.kv = torch.full((num_pages * page_size,), -1, dtype=torch.int64, device=self.device)
        self.page_size = page_size

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        start = time.perf_counter()
        self.kv[batch.slot_mapping] = batch.input_ids
        width = batch.block_tables.shape[1] * self.page_size
        offsets = torch.arange(width, device=self.device)
        pages = batch.block_tables.long()[:, offsets // self.page_size]
        valid = offsets[None, :] < batch.context_lens.long()[:, None]
        slots = torch.where(valid, pages * self.page_size + offsets % self.page_size, 0)
        tokens = torch.where(valid, self.kv[slots], 0)
        logits = self.table[_context_hash(tokens, valid.long()) % self.table.shape[0]]
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
        t = torch.tensor([tokens], device=self.device)
        return self.table[_context_hash(t, torch.ones_like(t)) % self.table.shape[0]][0]


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
