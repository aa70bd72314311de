"""The device work of one step: forward, sample, copy of the sampled ids to the host.

Each function is the body of one job queued on the device (device.py): it runs on the device
worker thread (CPU) or is issued on the compute / copy stream (CUDA), never on the scheduler's
critical path. Inputs come from the step's DecodeSlot, already staged by step.stage.

    forward(runner, step, previous_slot, threads, heads)
                                           upload inputs, gather decode ids from the previous
                                           step's samples, run the model; logits (and the region
                                           heads' hidden states) stay in the slot
    sample(slot, shape, heads)             grammar masks, greedy / seeded sampling into slot.sampled,
                                           then region values for region rows (regions.py)
    copy_to_host(slot, num_rows, debug)    slot.sampled -> slot.sampled_host (what commit reads)

`heads` is the runner as `regions.RegionHeads` when it has region heads (resolved once, by the
pipeline), else None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch

from . import sampler
from .regions import RegionHeads, RegionLogprobs
from .runner import ForwardBatch, ModelRunner
from .sampler import SamplingBatch
from .slot import DecodeSlot
from .step import Step

FORWARD_INPUTS = (
    "input_ids",
    "positions",
    "kv_index",
    "query_start",
    "context_lens",
    "block_tables",
    "gather_dst",
    "gather_src",
)
SLIDING_INPUTS = ("sliding_kv_index", "sliding_block_tables")
SAMPLE_INPUTS = ("temperature", "top_p", "top_k", "seeds", "counters", "random_rows", "mask_rows", "bitmask")
REGION_INPUTS = ("kinds", "region_rows")


@dataclass(slots=True, frozen=True)
class SampleShape:
    """How many rows of a step's sampling buffers are live."""

    num_rows: int
    num_random: int  # rows with temperature > 0
    num_masked: int  # rows with a grammar mask
    filter_rows: bool  # some random row uses top-k or top-p
    num_region: int = 0  # rows that sample a region value (regions.py)
    top_logprobs: int = -1  # alternatives to record per row; -1: no row asked for logprobs


@torch.inference_mode()
def forward(
    runner: ModelRunner,
    step: Step,
    previous_slot: DecodeSlot,
    threads: int | None = None,
    heads: RegionHeads | None = None,
) -> None:
    with intra_op_threads(threads):
        _forward(runner, step, previous_slot, heads)


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run a CPU forward on `threads` intra-op threads (device.threads_for), then put torch's count
    back: it is process-wide, and code beside an idle engine must find its own."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _forward(runner: ModelRunner, step: Step, previous_slot: DecodeSlot, heads: RegionHeads | None) -> None:
    # the launch's rows are the step's logit rows (a verify row's positions are rows of their own: step.py)
    slot, rows, tokens, decode = step.slot, step.num_logits, step.num_tokens, step.num_decode
    slot.upload(FORWARD_INPUTS, (tokens, tokens, tokens, rows + 1, rows, rows, decode, decode))
    dev = slot.dev
    if decode:  # decode rows' inputs: the ids the previous step sampled, never visiting the host
        gather_ids(dev.input_ids, dev.gather_dst[:decode], previous_slot.sampled, dev.gather_src[:decode])
    lanes = step.lane_of_row  # each launch row's lane (runner.OwnsKV)
    if step.drafts:  # a verify row's positions are rows of their own (step.py)
        assert lanes is not None and step.row_of_logit is not None  # by stage()
        lanes = lanes[step.row_of_logit]
    batch = ForwardBatch(
        input_ids=dev.input_ids[:tokens],
        positions=dev.positions[:tokens],
        query_start=dev.query_start[: rows + 1],
        context_lens=dev.context_lens[:rows],
        block_tables=dev.block_tables[:rows, : step.table_width],
        kv_index=dev.kv_index[:tokens],
        max_query_len=step.max_query_len,
        max_context_len=step.max_context_len,
        prefill=step.prefill_inputs,
        lanes=lanes,
    )
    if step.sliding:  # the sliding-window layers' pages (sliding.py)
        slot.upload(SLIDING_INPUTS, (tokens, rows))
        batch.sliding_kv_index = dev.sliding_kv_index[:tokens]
        batch.sliding_block_tables = dev.sliding_block_tables[:rows, : step.table_width]
    slot.logits = runner.forward(batch)
    if heads is not None:  # its last-token hidden states, for the sample job's region rows
        slot.hidden = heads.last_hidden


def gather_ids(input_ids: torch.Tensor, dst: torch.Tensor, sampled: torch.Tensor, src: torch.Tensor) -> None:
    """input_ids[dst] = sampled[src]. On CPU through numpy views, which keep the GIL: each torch op
    drops and takes it back, and the device thread then waits for the scheduler thread's turn (its
    commit runs just as a forward starts), which had cost a pipelined decode step more than its gather."""
    if input_ids.device.type == "cpu":
        input_ids.numpy()[dst.numpy()] = sampled.numpy()[src.numpy()]
    else:
        input_ids.index_copy_(0, dst, sampled.index_select(0, src))


@torch.inference_mode()  # runners return inference tensors; the sampler masks them in place
def sample(
    slot: DecodeSlot, shape: SampleShape, heads: RegionHeads | None = None, region_logprobs: bool = False
) -> None:
    rows, random, masked = shape.num_rows, shape.num_random, shape.num_masked
    slot.upload(SAMPLE_INPUTS, (rows, rows, rows, rows, rows, random, masked, masked))
    dev = slot.dev
    batch = SamplingBatch(
        temperature=dev.temperature[:rows],
        top_p=dev.top_p[:rows],
        top_k=dev.top_k[:rows],
        seeds=dev.seeds[:rows],
        counters=dev.counters[:rows],
        random_rows=dev.random_rows[:random] if random else None,
        filter_rows=shape.filter_rows,
        bitmask=dev.bitmask[:masked] if masked else None,
        mask_rows=dev.mask_rows[:masked] if masked else None,
        top_logprobs=shape.top_logprobs,
    )
    assert slot.logits is not None  # the forward job left them
    sampler.sample(slot.logits, batch, slot.sampled, slot.logprobs)
    if shape.num_region:  # region rows: their ids become value ids, on the device (regions.py)
        assert heads is not None and slot.hidden is not None  # only a region runner has region rows
        slot.upload(REGION_INPUTS, (rows, shape.num_region))
        region_rows = dev.region_rows[: shape.num_region]
        heads.sample_regions(slot.hidden, dev.kinds[:rows], region_rows, slot.sampled)
        if region_logprobs and shape.top_logprobs >= 0:
            cast(RegionLogprobs, heads).region_logprobs(  # region_logprobs: the runner conforms
                slot.hidden, dev.kinds[:rows], region_rows, slot.sampled, slot.logprobs, shape.top_logprobs
            )
    slot.logits = slot.hidden = None


def copy_to_host(slot: DecodeSlot, num_rows: int, debug: bool, top_logprobs: int = -1) -> None:
    if debug:
        slot.check_poisoned(num_rows)
    slot.sampled_host[:num_rows].copy_(slot.sampled[:num_rows], non_blocking=True)
    if top_logprobs >= 0:
        slot.copy_logprobs_to_host(num_rows, top_logprobs)
