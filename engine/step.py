"""`Step`: one launch of the pipeline, and the staging of its inputs into a DecodeSlot's host buffers.

PROBLEM
    Every tick the scheduler thread writes each row's query tokens, positions, KV slots, block-table
    row and the place of its input id into the slot's host buffers, while the device runs the step
    before. Built row by row in Python that costs microseconds per row, host time the pipeline must
    hide; and a decode row's input id is a token the host has not seen yet (step t's sample).
SOLUTION
    Rows keep their fixed state in lanes (lanes.py), so staging is a few numpy gathers by the rows'
    lanes. A row's query is one of three kinds:
      - prefill (output index 0): its prompt past the cached prefix, from the host;
      - decode: the one token its previous step sampled: the host writes only where that token sits
        in the previous slot's sampled ids (`gather_src`) and where it goes in this step's
        `input_ids` (`gather_dst`); the forward gathers it on the device (device_jobs.forward);
      - jump (jump-forward, pipeline.py): the k tokens the grammar forced after the previous step's
        context, from the host. The first of them is also what the previous step sampled (its mask
        allowed nothing else), so no id is gathered; the row's logits are those after the k-th, and
        its output index moves k on (k - 1 forced tokens, then the sampled one). The row after a
        verify step is a jump of one token: the token that step sampled last, known to the host
        once it has been committed.
    A decode row or a one-token jump row may carry drafts (`Step.drafts`, speculative decoding,
    pipeline.py): its query is then its input followed by the k drafts, and it has k + 1 *logit
    rows*, the logits after each query token, sampled with output indices n .. n + k. Logit rows
    are numbered across the step (`logit_start`), and every per-row sampling buffer of the slot
    (counters, temperatures, masks, sampled ids) is indexed by them; a step without drafts has
    exactly one logit row per row, and its runner is asked for the default logits.
INVARIANTS
    - A decode row was carried by the step right before this one (it never skips a step); a row
      that sits a step out (after a verify step) comes back as a jump row, its input from the host.
    - A step has at most max_batch logit rows (pipeline.py caps the drafts to the room left).
    - The block table covers the pages that hold the step's context, not every page reserved at
      admission (attention gathers, and traced decode pads, the table's width).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .kv_cache import pages_needed
from .lanes import Lanes
from .request import PrefillInputs
from .sequence import Sequence
from .sliding import SlidingPages
from .slot import DecodeSlot

if TYPE_CHECKING:
    from .bursts import Burst


@dataclass(slots=True, eq=False)
class Step:
    number: int
    slot: DecodeSlot
    rows: list[Sequence]
    lane_of_row: np.ndarray | None = None  # written by stage()
    num_tokens: int = 0
    num_decode: int = 0
    table_width: int = 0
    max_query_len: int = 0
    max_context_len: int = 0
    prefill_inputs: list[PrefillInputs | None] = field(default_factory=list)  # per row; [] when none
    extra: np.ndarray | None = None  # per row, query tokens past one (a jump row's k - 1); by stage()
    pinned: dict[int, list[int]] = field(default_factory=dict)  # row -> forced tokens, set at finalize
    partial: set[int] = field(default_factory=set)  # prefill rows whose chunk does not end the prompt
    top_logprobs: int = -1  # alternatives the step records per row; -1: no logprobs (set at finalize)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # row -> draft tokens it verifies (launch)
    logit_start: np.ndarray | None = None  # [B + 1] each row's first logit row (by stage())
    row_of_logit: np.ndarray | None = None  # [L] the row of each logit row (by stage())
    num_logits: int = 0  # logit rows: rows + drafts (by stage())
    sliding: bool = False  # it stages sliding-window pages too (by stage())
    burst: Burst | None = None  # a decode burst's k sub-steps (bursts.py; by bursts.stage())

    @property
    def num_rows(self) -> int:
        return len(self.rows)


def stage(
    step: Step, lanes: Lanes, page_size: int, row_numbers: np.ndarray, sliding: SlidingPages | None = None
) -> list[int]:
    """Write the step's inputs into its slot's host buffers; returns the prefill rows.

    `row_numbers` is np.arange(max_batch + 1), reused so that a decode-only step allocates nothing.
    A jump row's forced tokens (`Sequence.jump`) are consumed here: the launch owns them now.
    `sliding`: the sliding-window layers' pages, which each row moves on to its query (sliding.py).
    """
    output_index = np.array([seq.num_scheduled for seq in step.rows], dtype=np.int64)
    step.lane_of_row = np.array([seq.lane for seq in step.rows], dtype=np.int64)
    prefill_rows = np.flatnonzero(output_index == 0).tolist()
    jump_rows = [row for row, seq in enumerate(step.rows) if seq.jump]
    extra = step.extra = np.zeros(step.num_rows, dtype=np.int64)
    for row in jump_rows:
        jump = step.rows[row].jump
        assert jump is not None  # a jump row's
        extra[row] = len(jump) - 1
    for row, drafts in step.drafts.items():
        extra[row] += len(drafts)
    context = lanes.prompt_len[step.lane_of_row] + output_index + extra
    query_len = 1 + extra
    chunk_start = {}  # prefill row -> its chunk's first prompt token
    for row in prefill_rows:
        seq = step.rows[row]
        chunk_start[row] = seq.num_prefilled
        seq.num_prefilled += seq.chunk
        context[row], query_len[row] = seq.num_prefilled, seq.chunk
        if seq.num_prefilled < seq.prompt_len:
            step.partial.add(row)
    if sliding is not None:
        for seq, last, length in zip(step.rows, context.tolist(), query_len.tolist(), strict=True):
            sliding.advance(seq, last - length, last - 1)
    query_starts = _stage_positions(step, lanes, page_size, output_index + extra, context, query_len, row_numbers)
    _stage_logit_rows(step, lanes, output_index + extra, context, query_starts, row_numbers)
    _stage_input_sources(step, lanes, query_starts, chunk_start, jump_rows, row_numbers)
    if step.drafts and step.prefill_inputs:  # per launch row, and the launch's rows are the logit rows
        assert step.row_of_logit is not None  # by _stage_logit_rows
        step.prefill_inputs = [step.prefill_inputs[r] for r in step.row_of_logit.tolist()]
    return prefill_rows


def stage_sampling(host: Any, lanes: Lanes, lane: np.ndarray) -> tuple[int, bool]:
    """Each logit row's sampling parameters from its lane (`lane`: per logit row), and the rows that
    sample at random; returns how many do, and whether one of them uses top-k or top-p."""
    n = len(lane)
    host.temperature[:n], host.top_p[:n] = lanes.temperature[lane], lanes.top_p[lane]
    host.top_k[:n], host.seeds[:n] = lanes.top_k[lane], lanes.seed[lane]
    random_rows = np.flatnonzero(host.temperature[:n] > 0)
    host.random_rows[: len(random_rows)] = random_rows
    return len(random_rows), bool(((host.top_k[random_rows] > 0) | (host.top_p[random_rows] < 1)).any())


def _stage_positions(
    step: Step,
    lanes: Lanes,
    page_size: int,
    output_index: np.ndarray,
    context: np.ndarray,
    query_len: np.ndarray,
    row_numbers: np.ndarray,
) -> np.ndarray:
    """Positions, KV slots, query starts, context lengths, block tables; returns the query starts.

    Per row: `output_index`, the index of the token it samples (a jump row's is k - 1 past its
    scheduled count); `context`, its tokens in the KV once the launch ran; `query_len`, its query
    (a prefill chunk, a jump's k tokens, else 1).
    """
    host, lane, num_rows = step.slot.np, step.lane_of_row, step.num_rows
    assert lane is not None  # by stage()
    if (query_len > 1).any():
        query_starts = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(query_len, out=query_starts[1:])
        row_of_token = np.repeat(np.arange(num_rows), query_len)
        positions = (
            np.arange(query_starts[num_rows]) - query_starts[row_of_token] + (context - query_len)[row_of_token]
        )
        lane_of_token = lane[row_of_token]
        step.max_query_len = int(query_len.max())
    else:  # one query token per row
        query_starts, positions, lane_of_token = row_numbers[: num_rows + 1], context - 1, lane
        step.max_query_len = 1
    num_tokens = len(positions)
    page_index, offset = positions // page_size, positions % page_size
    host.positions[:num_tokens] = positions
    host.kv_index[:num_tokens] = lanes.block_table[lane_of_token, page_index] * page_size + offset
    host.query_start[: num_rows + 1] = query_starts
    host.context_lens[:num_rows] = context
    step.max_context_len = int(context.max())
    width = step.table_width = pages_needed(step.max_context_len, page_size)
    host.block_tables[:num_rows, :width] = lanes.block_table[lane, :width]
    if lanes.sliding_table is not None:
        step.sliding = True
        host.sliding_kv_index[:num_tokens] = lanes.sliding_table[lane_of_token, page_index] * page_size + offset
        host.sliding_block_tables[:num_rows, :width] = lanes.sliding_table[lane, :width]
    step.num_tokens = num_tokens
    return query_starts


def _stage_logit_rows(
    step: Step, lanes: Lanes, output_index: np.ndarray, context: np.ndarray, query_starts: np.ndarray,
    row_numbers: np.ndarray,
) -> None:
    """Logit rows and their counters (output indices). With drafts, the launch's rows are the logit
    rows: a verify row's k + 1 positions become rows of one token each, over its block table, their
    context lengths one apart (runner.SharedPages), so the forward is a decode launch."""
    host, num_rows = step.slot.np, step.num_rows
    if not step.drafts:
        step.logit_start, step.row_of_logit = row_numbers[: num_rows + 1], row_numbers[:num_rows]
        step.num_logits = num_rows
        host.counters[:num_rows] = output_index
        return
    assert step.lane_of_row is not None  # by stage()
    per_row = np.ones(num_rows, dtype=np.int64)
    for r, drafts in step.drafts.items():
        per_row[r] += len(drafts)
    start = step.logit_start = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(per_row, out=start[1:])
    num_logits = step.num_logits = int(start[num_rows])
    row = step.row_of_logit = np.repeat(np.arange(num_rows), per_row)
    back = start[row + 1] - 1 - np.arange(num_logits)  # logit rows after this one in its row
    host.counters[:num_logits] = output_index[row] - back  # a row's last logit row samples output_index
    # each logit row's query ends at its own token; a row without drafts keeps its whole query
    host.query_start[0] = 0
    host.query_start[1 : num_logits + 1] = query_starts[row + 1] - back
    step.max_query_len = int(np.diff(host.query_start[: num_logits + 1]).max())
    host.context_lens[:num_logits] = context[row] - back
    lane_of_logit = step.lane_of_row[row]
    host.block_tables[:num_logits, : step.table_width] = lanes.block_table[lane_of_logit, : step.table_width]
    if lanes.sliding_table is not None:
        host.sliding_block_tables[:num_logits, : step.table_width] = lanes.sliding_table[
            lane_of_logit, : step.table_width
        ]


def _stage_input_sources(
    step: Step,
    lanes: Lanes,
    query_starts: np.ndarray,
    chunk_start: dict[int, int],
    jump_rows: list[int],
    row_numbers: np.ndarray,
) -> None:
    """Prompt and forced tokens go up as they are; decode rows name their previous sample (gathered on the device)."""
    host, lane, num_rows = step.slot.np, step.lane_of_row, step.num_rows
    prefill_rows = list(chunk_start)
    running = np.setdiff1d(row_numbers[:num_rows], prefill_rows) if prefill_rows else row_numbers[:num_rows]
    assert lane is not None  # by stage()
    for row in jump_rows:
        seq = step.rows[row]
        assert seq.jump is not None  # a jump row's
        start = query_starts[row]
        host.input_ids[start : start + len(seq.jump)] = seq.jump
        seq.jump = None
    decode_rows = np.setdiff1d(running, jump_rows) if jump_rows else running
    decode_lanes = lane[decode_rows]
    if not (lanes.last_step[decode_lanes] == step.number - 1).all():
        raise AssertionError("a decoding sequence skipped a step")
    for row, drafts in step.drafts.items():  # after the input (gathered, or the jump's one token)
        host.input_ids[query_starts[row + 1] - len(drafts) : query_starts[row + 1]] = drafts
    num_decode = len(decode_rows)
    host.gather_dst[:num_decode] = query_starts[decode_rows]
    host.gather_src[:num_decode] = lanes.last_row[decode_lanes]
    # where each row's next input is sampled: its last logit row
    assert step.logit_start is not None  # by _stage_logit_rows
    lanes.last_step[lane], lanes.last_row[lane] = step.number, step.logit_start[1:] - 1
    step.num_decode = num_decode
    for row in prefill_rows:
        seq = step.rows[row]
        request = seq.request
        start = chunk_start[row]
        host.input_ids[query_starts[row] : query_starts[row + 1]] = request.prompt_ids[start : start + seq.chunk]
        if request.prefill is not None:
            step.prefill_inputs = step.prefill_inputs or [None] * num_rows
            step.prefill_inputs[row] = _past_the_cache(request.prefill, request.prompt_ids, seq.num_cached)


def _past_the_cache(prefill: PrefillInputs, prompt_ids: list[int], num_cached: int) -> PrefillInputs:
    """The prefill inputs of a prompt whose first `num_cached` tokens the prefix cache held: the
    runner then fills only the image tokens past them (kv_cache.prefix_seed keys such pages by image)."""
    if not num_cached or not prefill.num_image_tokens:
        return prefill
    assert prefill.image_token_id is not None  # set with num_image_tokens
    return replace(prefill, cached_image_tokens=prompt_ids[:num_cached].count(prefill.image_token_id))
