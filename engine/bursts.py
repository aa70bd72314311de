"""Decode bursts: one step of k decode sub-steps for rows that need no host work between tokens.

PROBLEM
    A decode step's host work (schedule, stage, launch, finalize, commit, the device jobs' hand-offs)
    is paid once per token. Where the forward is short and shares the CPU with that work (a small
    model on ggml's kernels, whose threads take every core), the host work is not hidden by the
    pipeline, it is added to each token: a bare loop of the same forwards decodes faster than the
    engine. Yet a row with no grammar, no logprobs, no drafts and no forced run needs nothing from
    the host between two of its tokens: its next input is its own sample, its next position and
    K/V slot are known at launch.
SOLUTION
    (vLLM's multi-step scheduling.) When every row of a step is such a row and no request waits,
    `length()` gives the step k sub-steps (the pipeline's `decode_burst`, capped so that no row
    samples at or past its max_tokens and the step's k * B logit rows fit max_batch). `stage()`
    writes every sub-step's positions, KV slots and context lengths at once (sub-step-major: sub-step
    i's rows are tokens i*B .. i*B + B - 1), and the step's logit rows row-major like a verify row's
    (row r's k samples are logit rows r*k .. r*k + k - 1, its counters n .. n + k - 1), so its
    last sample, where the next step gathers its input, is logit row r*k + k - 1. The device job
    `forward()` runs the k forwards back to back, sampling each with the row's parameters and
    counter n + i (counter-based noise: the same token decoding would sample) and feeding it to the
    next sub-step on the device; finalize queues only the copy of the samples to the host, and
    commit appends a row's k tokens one by one, text included, as for accepted drafts: a stop
    inside the burst ends the output where decoding would have, and the tokens after it are dropped.
    A host runner that continues its launches (runner.Continues: the ggml runner) gets only sub-step
    0 as a ForwardBatch; sub-steps 1 .. k - 1 are `forward_next` of the rows' last samples, in host
    arrays (`_continued`): no batch is built and the runner does not check its rows again.
    A request that arrives during a burst waits for it (at most k forwards): bursts are only taken
    while nothing waits, so the next launch admits it.
    On a CPU device the job reads each sub-step's samples: once every row has sampled one of its
    stop ids it ends the burst early (the rows are finished at commit), and a row's samples past
    its first stop id are that id. The next step, launched before that commit (pipelined), then
    gathers a stop id as every row's input: its rows are all finished at the commit before it
    (zombies), so its job runs no forward at all.
INVARIANTS (tests/engine/test_bursts.py)
    1. Greedy and seeded outputs are token-identical with and without bursts, pipelined and blocking.
    2. No row samples at or past its max_tokens; a burst step has at most max_batch logit rows.
    3. A stop id or stop string inside a burst ends the output there; nothing after it is emitted.
    4. Every page, lane and slot comes back (zombies of a burst, cancels during one).
    5. A burst is never taken while a request waits, nor for a row with a grammar, logprobs, a
       forced run or drafts, nor on a runner with region heads or sliding-window layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import sampler
from .device_jobs import gather_ids, intra_op_threads
from .kv_cache import pages_needed
from .lanes import Lanes
from .runner import Continues, ForwardBatch, ModelRunner
from .sampler import SamplingBatch
from .sequence import Sequence
from .slot import DecodeSlot, StepTensors
from .step import Step, stage_sampling

BURST_INPUTS = (
    "input_ids", "positions", "kv_index", "query_start", "context_lens", "block_tables", "gather_dst", "gather_src",
    "temperature", "top_p", "top_k", "seeds", "counters", "random_rows",
)


@dataclass(slots=True, frozen=True)
class Burst:
    """What a burst step's device job needs beyond the slot's buffers (set by `stage()`)."""

    length: int  # k sub-steps
    widths: tuple[int, ...]  # per sub-step, the block tables' width (pages of its longest context)
    longest: tuple[int, ...]  # per sub-step, its longest context
    num_random: int  # rows with temperature > 0 (the first of `random_rows`)
    filter_rows: bool  # some random row uses top-k or top-p
    stops: tuple[frozenset[int], ...]  # per row, its stop ids


def burstable(seq: Sequence) -> bool:
    """Whether a scheduled row needs nothing from the host between two of its tokens."""
    return (
        seq.num_scheduled > 0
        and seq.num_prefilled == seq.prompt_len
        and seq.matcher is None
        and seq.jump is None
        and seq.logprobs_k < 0
    )


def length(rows: list[Sequence], burst: int, max_batch: int, max_step_tokens: int) -> int:
    """The sub-steps of a step of `rows` (every one of them burstable); 0 when it is no burst."""
    k = min(burst, max_batch // len(rows), max_step_tokens // len(rows), *(s.max_tokens - s.num_scheduled for s in rows))
    return k if k >= 2 else 0


def stage(step: Step, lanes: Lanes, page_size: int, k: int) -> None:
    """Write a burst step's k sub-steps into its slot's host buffers (module docstring)."""
    host, rows = step.slot.np, step.num_rows
    lane = step.lane_of_row = np.array([seq.lane for seq in step.rows], dtype=np.int64)
    output_index = np.array([seq.num_scheduled for seq in step.rows], dtype=np.int64)
    step.extra = np.full(rows, k - 1, dtype=np.int64)  # the launch counts k output tokens a row
    # sub-step i of row r: position p + i, context p + i + 1, where p is the row's decode position
    context = (lanes.prompt_len[lane] + output_index)[None, :] + np.arange(k)[:, None]  # [k, B]
    positions = (context - 1).ravel()
    num_tokens = step.num_tokens = rows * k
    host.positions[:num_tokens] = positions
    host.kv_index[:num_tokens] = (
        lanes.block_table[np.tile(lane, k), positions // page_size] * page_size + positions % page_size
    )
    host.context_lens[:num_tokens] = context.ravel()
    host.query_start[: rows + 1] = np.arange(rows + 1)
    longest = context.max(axis=1).tolist()
    widths = [pages_needed(n, page_size) for n in longest]
    host.block_tables[:rows, : widths[-1]] = lanes.block_table[lane, : widths[-1]]
    step.table_width, step.max_query_len, step.max_context_len = widths[-1], 1, longest[-1]
    # logit rows, row-major: row r's samples are r*k .. r*k + k - 1 (a verify row's layout, step.py)
    starts = step.logit_start = np.arange(0, rows * k + 1, k, dtype=np.int64)
    step.row_of_logit = np.repeat(np.arange(rows), k)
    step.num_logits = rows * k
    host.counters[: rows * k] = (output_index[:, None] + np.arange(k)[None, :]).ravel()
    num_random, filter_rows = stage_sampling(host, lanes, lane)  # per row: each sub-step samples B rows
    # sub-step 0's inputs: each row's previous sample, gathered on the device (a decode row's, step.py)
    if not (lanes.last_step[lane] == step.number - 1).all():
        raise AssertionError("a decoding sequence skipped a step")
    host.gather_dst[:rows] = np.arange(rows)
    host.gather_src[:rows] = lanes.last_row[lane]
    lanes.last_step[lane], lanes.last_row[lane] = step.number, starts[1:] - 1
    step.num_decode = rows
    stops = tuple(seq.stop_ids for seq in step.rows)
    step.burst = Burst(k, tuple(widths), tuple(longest), num_random, filter_rows, stops)


@torch.inference_mode()
def forward(
    runner: ModelRunner,
    step: Step,
    previous_slot: DecodeSlot,
    threads: int | None = None,
    continues: Continues | None = None,
) -> None:
    """The device job of a burst step: k forwards, each sampled and fed to the next (module docstring).
    `continues`: the runner, where it runs a launch's next token without a batch (runner.Continues)."""
    with intra_op_threads(threads):
        _forward(runner, step, previous_slot, continues)


def _forward(runner: ModelRunner, step: Step, previous_slot: DecodeSlot, continues: Continues | None) -> None:
    burst, slot, rows = step.burst, step.slot, step.num_rows
    assert burst is not None  # a burst step's
    k, tokens = burst.length, rows * burst.length
    random = burst.num_random
    counts = (tokens, tokens, tokens, rows + 1, tokens, rows, rows, rows, rows, rows, rows, rows, tokens, random)
    slot.upload(BURST_INPUTS, counts)
    dev = slot.dev
    gather_ids(dev.input_ids, dev.gather_dst[:rows], previous_slot.sampled, dev.gather_src[:rows])
    samples = slot.sampled[:tokens].view(rows, k)
    on_cpu = samples.device.type == "cpu"
    if on_cpu and _all_stopped(dev.input_ids[:rows].tolist(), burst.stops):
        samples.copy_(dev.input_ids[:rows, None].expand(rows, k))  # zombies only: no forward (docstring)
        return
    first = dev.counters[:tokens:k]  # each row's first counter
    stopped: list[int | None] = [None] * rows  # per row, the first stop id it sampled
    # a runner that continues its launches (runner.Continues, on the host) is given the first
    # sub-step's batch only: the rest are the same rows one token on, which it knows
    batched = 1 if continues is not None else k
    for i in range(batched):
        span = slice(i * rows, (i + 1) * rows)
        sampled = _sample(runner.forward(_batch(dev, step, span, i)), dev, rows, burst, first + i)
        samples[:, i] = sampled
        if i + 1 < k:
            dev.input_ids[span.stop : span.stop + rows] = sampled
        if on_cpu and _note_stops(sampled.tolist(), burst.stops, stopped):
            break
    else:
        if continues is not None:
            _continued(continues, dev, samples.numpy(), burst, first, stopped)
    if on_cpu:  # a row's samples past its first stop id are that id: the next step sees its zombies
        for row, token in enumerate(stopped):
            if token is not None:
                at = int((samples[row] == token).nonzero()[0])
                samples[row, at:] = token


def _continued(
    runner: Continues, dev: StepTensors, samples: np.ndarray, burst: Burst, first: torch.Tensor, stopped: list
) -> None:
    """Sub-steps 1 .. k - 1 on a runner that continues its launches, in host arrays: each row's last
    sample is its next input; its samples go into `samples` ([rows, k], the slot's)."""
    rows = len(samples)
    tables = dev.block_tables[:rows, : burst.widths[-1]].numpy()  # every sub-step's pages
    for i in range(1, burst.length):
        logits = runner.forward_next(samples[:, i - 1], tables)
        if burst.num_random:
            samples[:, i] = _sample(torch.from_numpy(logits), dev, rows, burst, first + i).numpy()
        else:
            samples[:, i] = sampler.argmax_host(logits)
        if _note_stops(samples[:, i].tolist(), burst.stops, stopped):
            return


def _batch(dev: StepTensors, step: Step, span: slice, i: int) -> ForwardBatch:
    """Sub-step i's launch: its rows' tokens, positions, K/V slots and contexts (stage() wrote them)."""
    burst, rows = step.burst, step.num_rows
    assert burst is not None  # a burst step's
    return ForwardBatch(
        input_ids=dev.input_ids[span],
        positions=dev.positions[span],
        query_start=dev.query_start[: rows + 1],
        context_lens=dev.context_lens[span],
        block_tables=dev.block_tables[:rows, : burst.widths[i]],
        kv_index=dev.kv_index[span],
        max_query_len=1,
        max_context_len=burst.longest[i],
        prefill=[],
        lanes=step.lane_of_row,
    )


def _sample(logits: torch.Tensor, dev: StepTensors, rows: int, burst: Burst, counters: torch.Tensor) -> torch.Tensor:
    """A sub-step's samples: each row's parameters, its counter for this sub-step."""
    if not burst.num_random:  # greedy rows only: what the sampler gives them, without its batch
        return sampler.argmax_rows(logits.float())
    sampling = SamplingBatch(
        temperature=dev.temperature[:rows],
        top_p=dev.top_p[:rows],
        top_k=dev.top_k[:rows],
        seeds=dev.seeds[:rows],
        counters=counters,
        random_rows=dev.random_rows[: burst.num_random],
        filter_rows=burst.filter_rows,
        bitmask=None,
        mask_rows=None,
    )
    sampled = torch.empty(rows, dtype=torch.int64, device=logits.device)
    sampler.sample(logits, sampling, sampled)
    return sampled


def _all_stopped(tokens: list[int], stops: tuple[frozenset[int], ...]) -> bool:
    return all(token in stop for token, stop in zip(tokens, stops, strict=True))


def _note_stops(tokens: list[int], stops: tuple[frozenset[int], ...], stopped: list[int | None]) -> bool:
    """Record each row's first stop id; True once every row has sampled one."""
    for row, (token, stop) in enumerate(zip(tokens, stops, strict=True)):
        if stopped[row] is None and token in stop:
            stopped[row] = token
    return all(token is not None for token in stopped)
