"""`Step`: one launch of the pipeline, and the staging of its inputs into a DecodeSlot's host buffers.

PROBLEM
    Every tick the scheduler thread writes each row's query tokens, positions, KV slots, block-table
    row and the place of its input id into the slot's host buffers, while the device runs the step
    before. Built row by row in Python that costs microseconds per row, host time the pipeline must
    hide; and a decode row's input id is a token the host has not seen yet (step t's sample).
SOLUTION
    Rows keep their fixed state in lanes (lanes.py), so staging is a few numpy gathers by the rows'
    lanes. A row's query is its prompt (prefill: output index 0) or the one token its previous step
    sampled (decode): the host writes only where that token sits in the previous slot's sampled ids
    (`gather_src`) and where it goes in this step's `input_ids` (`gather_dst`); the forward gathers
    it on the device (device_jobs.forward).
INVARIANTS
    - A decode row was carried by the step right before this one (it never skips a step).
    - The block table covers the pages that hold the step's context, not every page reserved at
      admission (attention gathers, and traced decode pads, the table's width).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .kv_cache import pages_needed
from .lanes import Lanes
from .request import PrefillInputs
from .scheduler import Sequence
from .slot import DecodeSlot


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

    @property
    def num_rows(self) -> int:
        return len(self.rows)


def stage(step: Step, lanes: Lanes, page_size: int, row_numbers: np.ndarray) -> list[int]:
    """Write the step's inputs into its slot's host buffers; returns the prefill rows.

    `row_numbers` is np.arange(max_batch + 1), reused so that a decode-only step allocates nothing.
    """
    output_index = np.array([seq.num_scheduled for seq in step.rows], dtype=np.int64)
    step.lane_of_row = np.array([seq.lane for seq in step.rows], dtype=np.int64)
    prefill_rows = np.flatnonzero(output_index == 0).tolist()
    query_starts = _stage_positions(step, lanes, page_size, output_index, prefill_rows, row_numbers)
    _stage_input_sources(step, lanes, query_starts, prefill_rows, row_numbers)
    return prefill_rows


def _stage_positions(
    step: Step,
    lanes: Lanes,
    page_size: int,
    output_index: np.ndarray,
    prefill_rows: list[int],
    row_numbers: np.ndarray,
) -> np.ndarray:
    """Positions, KV slots, query starts, context lengths, block tables; returns the query starts."""
    host, lane, num_rows = step.slot.np, step.lane_of_row, step.num_rows
    context = lanes.prompt_len[lane] + output_index  # a prefill's context is its prompt
    if prefill_rows:  # a prefill's query is its prompt past the pages the prefix cache held
        query_len = np.where(output_index > 0, 1, context - lanes.cached_len[lane])
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
    pages = lanes.block_table[lane_of_token, positions // page_size]
    host.positions[:num_tokens] = positions
    host.kv_index[:num_tokens] = pages * page_size + positions % page_size
    host.query_start[: num_rows + 1] = query_starts
    host.context_lens[:num_rows] = context
    host.counters[:num_rows] = output_index
    step.max_context_len = int(context.max())
    step.table_width = pages_needed(step.max_context_len, page_size)
    host.block_tables[:num_rows, : step.table_width] = lanes.block_table[lane, : step.table_width]
    step.num_tokens = num_tokens
    return query_starts


def _stage_input_sources(
    step: Step, lanes: Lanes, query_starts: np.ndarray, prefill_rows: list[int], row_numbers: np.ndarray
) -> None:
    """Prompt tokens go up as they are; decode rows name their previous sample (gathered on the device)."""
    host, lane, num_rows = step.slot.np, step.lane_of_row, step.num_rows
    decode_rows = np.setdiff1d(row_numbers[:num_rows], prefill_rows) if prefill_rows else row_numbers[:num_rows]
    decode_lanes = lane[decode_rows]
    if not (lanes.last_step[decode_lanes] == step.number - 1).all():
        raise AssertionError("a running sequence skipped a step")
    num_decode = len(decode_rows)
    host.gather_dst[:num_decode] = query_starts[decode_rows]
    host.gather_src[:num_decode] = lanes.last_row[decode_lanes]
    lanes.last_step[lane], lanes.last_row[lane] = step.number, row_numbers[:num_rows]
    step.num_decode = num_decode
    for row in prefill_rows:
        seq = step.rows[row]
        request = seq.request
        host.input_ids[query_starts[row] : query_starts[row + 1]] = request.prompt_ids[seq.num_cached :]
        if request.prefill is not None:
            step.prefill_inputs = step.prefill_inputs or [None] * num_rows
            step.prefill_inputs[row] = request.prefill
