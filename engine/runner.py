"""The contract between the engine and a model: the runner protocols and the `ForwardBatch` a runner consumes.

PROBLEM
    The engine owns scheduling, the paged KV pool's *bookkeeping* (which page belongs to whom) and
    sampling; a model family owns its weights, its attention and its multimodal encoders. The two
    meet at one call per launch, and that call must be expressible as a single queued unit of device
    work: every input it needs is already a tensor on the runner's device when it is launched.

SOLUTION
    A launch is one `ForwardBatch`: a flat ("varlen") batch of query tokens from several sequences,
    prefill and decode alike (decode is a query of length 1). The engine fills its tensors from a
    DecodeSlot's preallocated buffers; for decode steps `input_ids` is gathered on the device from
    the previous step's sampled ids, so it never visits the host. The runner writes the new tokens'
    K/V into its own KV tensors at `kv_index`, attends over `block_tables`/`context_lens`, and
    returns the logits of each sequence's last query token.
    A speculative verify step (pipeline.py) launches the k + 1 positions of one sequence as k + 1
    rows of one token each, over the same block table, their context lengths one apart: row i
    attends to the K/V rows 0..i-1 write in the same launch. So a runner that is given such
    launches writes every row's K/V before any row attends (paged attention does, layer by layer),
    and a verify step is an ordinary decode launch (one token a row: the traced decode graphs).

    What the engine calls on a runner is declared here, and checked once, when the Engine is built
    (matcher.require: a TypeError naming what is missing), never probed per step:
      - `ModelRunner` (required): `vocab_size`, `device`, `max_positions`, `kv_bytes_per_token`,
        `allocate_kv`, `forward`;
      - `Quiesce` (optional): `quiesce()`, called by `Engine.close()` for a runner with work of its
        own (background traces, say);
      - `SharedPages` (optional): `rows_share_pages = True`, a runner whose rows may read K/V that
        other rows of the same launch write (above); speculative decoding needs it (and is refused
        without it);
      - `SlidingWindow` (optional): sliding-window layers whose K/V lives in a pool of its own,
        of which each sequence holds only its window (sliding.py);
      - `regions.RegionHeads` (optional): region values sampled on the device (regions.py);
      - `OwnsKV` (optional): a runner whose K/V lives in memory of its own (the ggml runner:
        llama.cpp's), not in tensors the engine's pages index. The engine keeps its pages as
        bookkeeping all the same (the prefix cache, rollback, admission are unchanged) and gives
        each row's lane (`ForwardBatch.lanes`), so the runner keeps one sequence of its own per
        lane and mirrors the pages: it must treat a row's block table and context length as the
        truth (tokens before `context_len - query_len` are cached: the same pages hold the same
        tokens), drop what its sequence holds past them (a rolled-back draft, a lane that now
        runs another sequence), and obtain cached tokens it lacks by copying them from another of
        its sequences or by computing them again. `allocate_streams` replaces `allocate_kv`;
      - `Continues` (optional): `forward_next(input_ids, block_tables)`, the launch right after a
        `forward` whose rows were one sequence each, every row one token on at its next position:
        the runner already knows the rows, their lanes and positions, so a decode burst's
        sub-steps after its first (bursts.py) skip the batch's staging and the runner's checks;
      - `OwnThreads` (optional): `own_threads`, the size of a thread pool of the runner's own that
        runs its kernels (ggml's): the device then leaves torch's intra-op count alone for its
        forwards and does not time them (device.py's ThreadChooser has nothing to choose).

INVARIANTS
    - `forward` never synchronizes with the host (no `.item()`, no `.tolist()`, no `.cpu()` on
      device tensors) except where the runner's device *is* the host.
    - `forward` reads and writes only the KV pages named in the batch.
    - Logits have `vocab_size` columns; ids the tokenizer does not have (padded embedding rows) are
      the engine's and the grammar's to mask, not the runner's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .matcher import conforms
from .request import PrefillInputs


@dataclass(slots=True)
class ForwardBatch:
    """One launch over `num_seqs` sequences and `num_tokens` query tokens (all tensors on the runner's device).

    input_ids:     [T] int64, the query tokens, sequence after sequence.
    positions:     [T] int64, each query token's position in its sequence (0-based).
    query_start:   [B + 1] int32, cumulative query lengths (sequence i owns tokens query_start[i]:query_start[i+1]).
    context_lens:  [B] int32, tokens in each sequence's KV after this launch (cached + new).
    block_tables:  [B, P] int32, the KV page ids of each sequence in order, padded with -1.
    kv_index:  [T] int64, where each query token's K/V is written: page_id * page_size + offset.
    max_query_len: the longest query in the batch (1 for a pure decode step); a host int.
    max_context_len: the longest context in the batch; a host int.
    prefill:       per sequence, its `PrefillInputs` (images, prefix length) or None; an empty list
                   when no sequence has any (always for decode steps).
    lanes:         per row, the lane (lanes.py) of its sequence, for an `OwnsKV` runner; None for others.
    sliding_block_tables, sliding_kv_index: the same for the K/V tensors of a `SlidingWindow`
                   runner's sliding layers, in their own page pool (sliding.py); None for other runners.
                   Entries of pages the window has passed are -1.
    A "sequence" here is a row of the launch; rows may share pages (a verify step's positions,
    above), which only runners that declare `SharedPages` are given.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    kv_index: torch.Tensor
    max_query_len: int
    max_context_len: int
    prefill: list[PrefillInputs | None] = field(default_factory=list)
    sliding_block_tables: torch.Tensor | None = None
    sliding_kv_index: torch.Tensor | None = None
    lanes: np.ndarray | None = None  # per row, its sequence's lane (host ints): `OwnsKV` runners only

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


@runtime_checkable
class ModelRunner(Protocol):
    """What the engine drives. One instance per loaded model; `forward` is called from one thread only
    (the device's: CpuDevice's worker thread, or the scheduler thread issuing CUDA work)."""

    vocab_size: int  # logits width; may exceed the tokenizer's size (padded embedding rows)
    device: torch.device
    max_positions: int | None  # the longest sequence the model supports; None: no limit of its own

    def kv_bytes_per_token(self) -> int:
        """Bytes of K/V cache one token costs across all layers (for sizing the page pool from a budget)."""
        ...

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        """Allocate the KV tensors: `num_pages` pages of `page_size` tokens each, on `device`."""
        ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one launch; return [num_seqs, vocab_size] float logits at each sequence's last query token."""
        ...


@runtime_checkable
class Quiesce(Protocol):
    """A runner with work of its own besides `forward` (background traces): `Engine.close()` waits for it."""

    def quiesce(self) -> None:
        """Block until the runner's own background work has ended; the runner stays usable."""
        ...


@runtime_checkable
class SharedPages(Protocol):
    """A runner whose rows may read the K/V other rows of the same launch write (their block tables
    name the same pages): `rows_share_pages = True`. Speculative decoding verifies drafts with such
    launches (pipeline.py, SPECULATIVE DECODING); a runner without it gets none. A runner whose
    kernels compute a launch's several positions of one sequence with other rounding than one position
    at a time says so with `verify_rows_exact = False`: drafts then run, with a warning that greedy
    text may differ from decoding without them."""

    rows_share_pages: bool


@runtime_checkable
class SlidingWindow(Protocol):
    """A runner some of whose KV tensors serve only sliding-window layers, of one window: it keeps
    them in a page pool of their own, in which a sequence holds only its window's pages (sliding.py).
    `sliding_window`: the window in positions (a query at p reads keys p - window + 1 .. p), None
    when the runner has no such tensor; `sliding_kv_bytes_per_token()`: those tensors' share of
    `kv_bytes_per_token()`; `allocate_kv(num_pages, page_size, sliding_pages=n)` gives them n pages."""

    sliding_window: int | None

    def sliding_kv_bytes_per_token(self) -> int: ...


@runtime_checkable
class OwnsKV(Protocol):
    """A runner that keeps its K/V itself (the module docstring): `owns_kv = True`, and the engine
    calls `allocate_streams` instead of `allocate_kv`: `lanes` sequences of up to `max_len` tokens,
    launches of up to `max_tokens` tokens, over the engine's `num_pages` pages of `page_size`."""

    owns_kv: bool

    def allocate_streams(self, num_pages: int, page_size: int, lanes: int, max_len: int, max_tokens: int) -> None: ...


@runtime_checkable
class Continues(Protocol):
    """A host runner that continues its last launch: `forward_next(input_ids, block_tables)` runs the
    rows of the `forward` (or `forward_next`) just before it again, in the same order, each with the
    one token `input_ids[r]` at the position after its last one; `block_tables` name that position's
    page. Host arrays in and out: [rows, vocab_size] float32 logits, which may be a view of the
    runner's own buffer, valid until its next launch. Valid only after a launch whose rows were one
    sequence each (no verify rows); the runner raises otherwise. Decode bursts use it on the host
    for their sub-steps after the first."""

    def forward_next(self, input_ids: np.ndarray, block_tables: np.ndarray) -> np.ndarray: ...


@runtime_checkable
class OwnThreads(Protocol):
    """A runner whose kernels run on a thread pool of their own (ggml's), not on torch's intra-op
    threads: `own_threads`, how many. The engine then neither sets nor times torch's count for its
    forwards (device.threads_for), and reports `own_threads` as the decode threads."""

    own_threads: int


@runtime_checkable
class Described(Protocol):
    """A runner that says what it runs on (`describe()`: its library and kernels), for the user."""

    def describe(self) -> str: ...


def describe(runner: ModelRunner) -> str:
    """What `runner` runs on: its own `describe()`, else torch's device and dtype."""
    if conforms(runner, Described):
        return runner.describe()
    dtype = str(getattr(runner, "dtype", "")).removeprefix("torch.")
    return f"torch ({runner.device.type}{', ' + dtype if dtype else ''})"


def owns_kv(runner: ModelRunner) -> bool:
    """Whether `runner` declares `OwnsKV` (checked once, when the engine is built)."""
    return conforms(runner, OwnsKV) and bool(runner.owns_kv)


def own_threads(runner: ModelRunner) -> int | None:
    """The size of `runner`'s own thread pool (`OwnThreads`), or None: its kernels run on torch's."""
    return int(runner.own_threads) if conforms(runner, OwnThreads) else None


def sliding_window(runner: ModelRunner) -> int | None:
    """The window of `runner`'s sliding-only KV tensors (`SlidingWindow`), or None."""
    return runner.sliding_window if conforms(runner, SlidingWindow) else None


def shares_pages(runner: ModelRunner) -> bool:
    """Whether `runner` declares `SharedPages` (checked once, when the engine is built)."""
    return conforms(runner, SharedPages) and bool(runner.rows_share_pages)
