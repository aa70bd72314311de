"""DecodeSlot: one of the two preallocated sets of step buffers the pipeline ping-pongs between.

PROBLEM
    Step t+1 is launched while step t is still in flight, so the two need separate buffers, and
    allocating them per step would cost the host time the pipeline is meant to hide.
SOLUTION
    Two slots, allocated once at the engine's largest step (max_batch rows, max_step_tokens tokens,
    max_pages per row; per-row sampling buffers hold max_batch logit rows, step.py). Host-side staging tensors (pinned on CUDA) are written by the scheduler and
    copied to device tensors by the launched work; on CPU both sides are the same tensors (the
    scheduler writes them through numpy views, the cheapest way in from Python lists). Sampled
    ids are written on the device, copied to `sampled_host`, and read by commit.
INVARIANTS
    - A slot moves FREE -> LAUNCHED -> FINALIZED -> FREE; it becomes FREE only in commit, after the
      CPU has read `sampled_host` (not when the device is done with it).
    - In debug mode `sampled_host` is poisoned after every read, and the device-side copy checks
      the poison is there before writing: an overwrite of unread ids raises.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

import torch

from .device import Device
from .request import MAX_LOGPROBS
from .sampler import LogprobBuffers

POISON = -0x5EED  # never a token id


class SlotState(Enum):
    FREE = "free"
    LAUNCHED = "launched"
    FINALIZED = "finalized"


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor  # [T] int64 prompt tokens; decode rows are gathered on the device
    positions: torch.Tensor  # [T] int64
    kv_index: torch.Tensor  # [T] int64
    query_start: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, P] int32
    sliding_kv_index: torch.Tensor  # [T] int64, in the sliding-window layers' pool (sliding.py; unused without)
    sliding_block_tables: torch.Tensor  # [B, P] int32, their pages
    gather_dst: torch.Tensor  # [B] int64 decode tokens' places in input_ids
    gather_src: torch.Tensor  # [B] int64 their rows in the previous step's sampled ids
    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64
    random_rows: torch.Tensor  # [B] int64
    mask_rows: torch.Tensor  # [B] int64
    bitmask: torch.Tensor  # [B, W] int32
    kinds: torch.Tensor  # [B] int64 step kind per row (regions.py; 0 = token)
    region_rows: torch.Tensor  # [B] int64 rows whose kind is not 0

    @staticmethod
    def allocate(max_batch: int, max_tokens: int, max_pages: int, mask_words: int) -> StepTensors:
        def ints(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype)

        return StepTensors(
            input_ids=ints(max_tokens),
            positions=ints(max_tokens),
            kv_index=ints(max_tokens),
            query_start=ints(max_batch + 1, dtype=torch.int32),
            context_lens=ints(max_batch, dtype=torch.int32),
            block_tables=ints(max_batch, max_pages, dtype=torch.int32),
            sliding_kv_index=ints(max_tokens),
            sliding_block_tables=ints(max_batch, max_pages, dtype=torch.int32),
            gather_dst=ints(max_batch),
            gather_src=ints(max_batch),
            temperature=ints(max_batch, dtype=torch.float32),
            top_p=ints(max_batch, dtype=torch.float32),
            top_k=ints(max_batch),
            seeds=ints(max_batch),
            counters=ints(max_batch),
            random_rows=ints(max_batch),
            mask_rows=ints(max_batch),
            bitmask=ints(max_batch, mask_words, dtype=torch.int32),
            kinds=ints(max_batch),
            region_rows=ints(max_batch),
        )

    def map(self, fn: Any) -> StepTensors:
        return StepTensors(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})


class DecodeSlot:
    def __init__(
        self, index: int, device: Device, max_batch: int, max_tokens: int, max_pages: int, mask_words: int
    ) -> None:
        self.index = index
        host = StepTensors.allocate(max_batch, max_tokens, max_pages, mask_words)
        on_cpu = device.device.type == "cpu"
        self.host = host if on_cpu else host.map(device.pin)
        # numpy views of the host tensors: filling them from lists is far cheaper than torch.tensor()
        self.np: Any = self.host.map(lambda t: t.numpy())
        self.dev = host if on_cpu else host.map(lambda t: torch.empty_like(t, device=device.device))
        self.sampled = torch.zeros(max_batch, dtype=torch.int64, device=device.device)
        self.sampled_host = device.pin(torch.full((max_batch,), POISON, dtype=torch.int64))
        # logprobs of the sampled ids and the top alternatives, for steps where a row asks for them
        self.logprobs = self._logprob_buffers(max_batch, lambda t: t.to(device.device))
        self.logprobs_host = self._logprob_buffers(max_batch, device.pin)
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # a region runner's last-token hidden states (regions.py)
        self.state = SlotState.FREE
        self.step: Any = None  # the Step occupying this slot
        self.event: Any = None  # set when sampled_host holds the step's ids

    @staticmethod
    def _logprob_buffers(max_batch: int, place: Any) -> LogprobBuffers:
        return LogprobBuffers(
            chosen=place(torch.zeros(max_batch, dtype=torch.float32)),
            top_values=place(torch.zeros(max_batch, MAX_LOGPROBS, dtype=torch.float32)),
            top_ids=place(torch.zeros(max_batch, MAX_LOGPROBS, dtype=torch.int64)),
        )

    def copy_logprobs_to_host(self, n: int, k: int) -> None:
        dev, host = self.logprobs, self.logprobs_host
        host.chosen[:n].copy_(dev.chosen[:n], non_blocking=True)
        if k:
            host.top_values[:n, :k].copy_(dev.top_values[:n, :k], non_blocking=True)
            host.top_ids[:n, :k].copy_(dev.top_ids[:n, :k], non_blocking=True)

    def read_logprobs(self, n: int, k: int) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """The sampled ids' logprobs and the top k alternatives (ids, logprobs) of the first n rows."""
        host = self.logprobs_host
        chosen = host.chosen[:n].tolist()
        if not k:
            return chosen, [[] for _ in range(n)], [[] for _ in range(n)]
        return chosen, host.top_ids[:n, :k].tolist(), host.top_values[:n, :k].tolist()

    def upload(self, names: tuple[str, ...], counts: tuple[int, ...]) -> None:
        """Copy the first `count` entries of host tensors to the device ones (no-op on CPU)."""
        if self.dev is self.host:
            return
        for name, count in zip(names, counts, strict=True):
            getattr(self.dev, name)[:count].copy_(getattr(self.host, name)[:count], non_blocking=True)

    def read_sampled(self, n: int, debug: bool) -> list[int]:
        ids = self.sampled_host[:n].tolist()
        if debug:
            if POISON in ids:
                raise AssertionError(f"slot {self.index}: commit read ids the device never wrote: {ids}")
            self.sampled_host[:n].fill_(POISON)
        return ids

    def check_poisoned(self, n: int) -> None:
        """Debug (CPU device): the host ids about to be overwritten were read by commit."""
        if not bool((self.sampled_host[:n] == POISON).all()):
            raise AssertionError(f"slot {self.index}: host ids overwritten before commit read them")
