"""`GgmlRunner`: a GGUF checkpoint's forward on ggml's own CPU kernels (llama.cpp, through
llama-cpp-python's low-level API), under foveal's engine (the `gguf` extra).

PROBLEM
    A GGUF file is made for ggml: its Q4 x Q8 dot products are the fastest CPU kernels for those
    weights, and torch's own kernels decode the same file at about half llama.cpp's speed. Yet what
    makes foveal faster than llama.cpp on structured and concurrent work lives above the forward
    (batching, grammar masks, jump-forward, drafts, the prefix cache) and must not change. ggml keeps
    the K/V in its own memory, though, while the engine's paged KV cache is bookkeeping the engine
    owns (which page holds which tokens, which full pages several prompts share).
SOLUTION
    The engine's pages stay the truth; llama.cpp's memory mirrors them. Each of the engine's lanes
    (lanes.py: a running sequence's row of fixed state) is one llama.cpp sequence, in a stream of its
    own (`kv_unified` off), so a row never attends another's cells and, while its stream holds at
    most 256 tokens, its numerics are those of a batch of one whatever else shares the launch
    (past that, ggml's flash attention computes one query alone with its keys split across the
    threads, and a launch of several queries row by row: the two round apart). The runner
    remembers, per stream, the chain of pages it holds (each page with the generation it had when
    written, bumped whenever a page is written from its first slot again) and, per page, the tokens
    written into it. At each row it compares its stream with the row's
    block table and the tokens the engine says are cached:
      - the longest prefix that agrees is kept; what lies past it (a rolled-back draft, a lane that
        now runs another sequence) is removed (`llama_memory_seq_rm`);
      - a missing prefix is copied from another stream that holds those pages (`seq_cp`: a prefix
        cache hit, a shared system prompt), and what no stream holds any more is computed again
        from the remembered tokens, before the row's own query;
      - the first tokens of a row's query that its stream already holds past that prefix (the
        same tokens: a new prompt that goes on like the lane's previous one beyond their shared
        whole pages) are kept, not computed again, as llama.cpp's completion API keeps its last
        prompt's: the engine's prefix cache shares whole pages only, the runner's memory holds
        tokens, so a chat's system prompt is reused to its last token (`_reusable`);
      - the row's query tokens go into one `llama_decode` with every other row's, logits for each
        row's last token (each position of a verify row: `SharedPages`), the rows in lane order:
        llama.cpp makes one pass over the weights per run of consecutive sequence ids it meets in
        increasing order (and one more per length a run's rows do not share).
    A decode burst's later sub-steps (engine/bursts.py) are `forward_next` (`runner.Continues`): the
    same rows as the launch before, one token on, so the runner only notes each row's new token and
    writes the batch in place; their logits are a view of llama.cpp's output buffer.
    ctypes releases the GIL for the whole `llama_decode`, so the pipeline's host work overlaps it.
    llama.cpp allocates and clears a context's whole K/V when it is made, so the first context holds
    two short streams, and a launch that needs a higher lane or a longer row makes a larger one and
    moves every stream's K/V into it (`_fit`: llama.cpp's per-sequence state).
INVARIANTS
    - A stream's tokens before a row's cached length are exactly the row's (same pages, same
      generations), and the query tokens it keeps past them are the row's own; nothing else is
      ever attended.
    - A copy holds only what its donor's memory holds when it is made: a stream that the same launch
      writes donates at most the tokens it held before the launch.
    - At batch 1 the logits are llama.cpp's own for the same prompt ids (llama-cpp-python's
      completion API): same kernels, same stream layout (tests/models/test_ggml.py).
    - `forward_next` runs only right after a launch whose rows were one sequence each, on the same
      lanes: their streams then end at those rows' last tokens, which is where it writes.
    - Growing the context changes no row: a moved stream holds the same cells in the same order (a
      state that cannot be moved is dropped and its tokens computed again).
    - A failed `llama_decode` raises (the engine fails the requests in flight); it never
      corrupts a stream silently: the streams it touched are cleared and recomputed when next used.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from foveal.engine.models.arch import ModelLoadError

INSTALL = (
    "pip install -c constraints.txt -e '.[gguf]' in foveal's clone (llama-cpp-python builds from source; "
    "docs/install.md#gguf says how to build it for any CPU)"
)
STREAM_ALIGN = 256  # llama.cpp pads a stream's cells to this
# the first context's streams and their length: K/V is allocated and cleared when a context is made
# (64 streams of 4,096 tokens of SmolLM2-135M would be 6 GB at load), so it grows with the launches
FIRST_STREAMS, FIRST_STREAM_LEN = 2, STREAM_ALIGN
# llama.cpp's per-sequence state (llama_state_seq_get_data) starts: magic, sequence id, its cache's
# stream count; then, per stream, a cell count (the sequence's stream: its cells, K and V)
STATE_HEADER = struct.Struct("<IiI")
LOG_ERROR = 3  # ggml_log_level's GGML_LOG_LEVEL_ERROR
log = logging.getLogger("foveal.ggml")
_errors: deque[str] = deque(maxlen=8)  # llama.cpp's last error lines, for the messages below
_callback: Any = None  # the ctypes callback, kept alive while llama.cpp holds it


AVX2_ARGS = (
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    # ggml's own thread pool, not OpenMP: an OpenMP build shares torch's libgomp (one soname), whose
    # barriers stop spinning and sleep once the process has more OpenMP threads than CPUs (torch's
    # pool beside ggml's), and every ggml barrier then waits on a futex
    "-DGGML_OPENMP=OFF",
)
OPENMP_SLOW = (
    "this llama-cpp-python was built with OpenMP, which shares torch's OpenMP runtime in foveal's process: "
    "once torch has run an operation in another thread, ggml's barriers sleep, and a step can take twice as "
    "long. Rebuild it with CMAKE_ARGS=\"$(python -m foveal.engine.models.ggml)\" "
    "(docs/models/index.md#gguf-files-on-llamacpps-kernels)"
)
AVX512_FLAGS = {  # /proc/cpuinfo flag -> the ggml option that uses it
    "avx512f": "-DGGML_AVX512=ON",
    "avx512vbmi": "-DGGML_AVX512_VBMI=ON",
    "avx512_vnni": "-DGGML_AVX512_VNNI=ON",
    "avx512_bf16": "-DGGML_AVX512_BF16=ON",
}


def cmake_args(cpu_flags: set[str], avx512: bool = True) -> str:
    """llama-cpp-python's CMAKE_ARGS for a CPU with these /proc/cpuinfo flags: never -march=native
    and never AMX (the virtual machines here refuse its tile instructions), AVX2 always, and the
    AVX-512 extensions the CPU has when `avx512` (a build for this CPU kind only: it dies with
    SIGILL on an AVX2-only one)."""
    if "avx2" not in cpu_flags:
        raise ValueError("this CPU has no AVX2: build llama-cpp-python the default way for it")
    extra = [arg for flag, arg in AVX512_FLAGS.items() if avx512 and "avx512f" in cpu_flags and flag in cpu_flags]
    return " ".join([*AVX2_ARGS, *(extra or ["-DGGML_AVX512=OFF"])])


def available() -> bool:
    """Whether llama-cpp-python imports (the `gguf` extra is installed)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):  # OSError: a shared library built for another CPU or missing
        return False
    return True


def _llama() -> Any:
    global _callback
    try:
        import llama_cpp
    except (ImportError, OSError) as error:
        raise ModelLoadError(f"runner='ggml' needs llama-cpp-python ({error}); {INSTALL}") from None
    if _callback is None:  # llama.cpp logs every load to stderr: to logging instead, errors kept

        def on_log(level: int, text: bytes, user_data: Any) -> None:
            line = text.decode("utf-8", "replace").rstrip()
            if level == LOG_ERROR and line:
                _errors.append(line)
            log.debug("%s", line)

        _callback = llama_cpp.llama_log_callback(on_log)
        llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
    return llama_cpp


def _last_error() -> str:
    return _errors[-1] if _errors else "no error message"


@dataclass(slots=True)
class Stream:
    """What one llama.cpp sequence holds: `length` tokens over `chain`'s pages (page id, generation)."""

    length: int = 0
    chain: list[tuple[int, int]] = field(default_factory=list)


class Fill(NamedTuple):
    """One stream's part of a launch: its tokens from position `start`, logits at `offsets` among
    them, which are the launch's rows `first_row` on."""

    lane: int
    start: int
    tokens: np.ndarray
    offsets: list[int]
    first_row: int


class GgmlRunner:
    """The engine's `ModelRunner` over a llama.cpp model: `OwnsKV` (its K/V is llama.cpp's),
    `SharedPages` (a verify step's positions are one stream's consecutive tokens) and `OwnThreads`."""

    owns_kv = True
    rows_share_pages = True
    # a verify row's positions go through ggml's many-token kernels, which round apart from one at a
    # time: drafts can change greedy text at near-ties (pipeline.check_speculative warns)
    verify_rows_exact = False

    def __init__(self, path: Path, threads: int | None = None) -> None:
        self.L = _llama()
        self.path = path
        self.threads = threads or torch.get_num_threads()
        self.L.llama_backend_init()
        params = self.L.llama_model_default_params()
        _errors.clear()
        self.model = self.L.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ModelLoadError(
                f"llama.cpp could not load {path}: {_last_error()}; load it with runner='torch', or a "
                "llama-cpp-python whose llama.cpp knows this file"
            )
        if "OPENMP = 1" in self.L.llama_print_system_info().decode():
            log.warning("%s", OPENMP_SLOW)
        self.vocab = self.L.llama_model_get_vocab(self.model)
        self.vocab_size = int(self.L.llama_vocab_n_tokens(self.vocab))
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.max_positions = int(self.L.llama_model_n_ctx_train(self.model)) or None
        self.ctx: Any = None
        self.streams: list[Stream] = []
        self.grown = 0  # contexts made (the first included)
        # cached tokens the rows found in their own stream, copied from another, or computed again;
        # query tokens a row's stream already held (`_reusable`)
        self.stats = {"kept": 0, "copied": 0, "recomputed": 0, "reused": 0}
        # the last launch's lanes in row order when each row was one sequence (runner.Continues)
        self.last_lanes: list[int] | None = None
        self.last_order: list[int] | None = None  # its rows in lane order (the batch's), None if they were
        self._views: dict[tuple[int, int], np.ndarray] = {}  # views of llama.cpp's logits (_outputs)

    # ---- the engine's contract ------------------------------------------------------------------
    @property
    def own_threads(self) -> int:
        """`runner.OwnThreads`: ggml's thread pool runs the forward, whatever torch's count is."""
        return self.threads

    def kv_bytes_per_token(self) -> int:
        """K and V in f16 (llama.cpp's default cache type) across the layers."""
        layers = int(self.L.llama_model_n_layer(self.model))
        heads_kv = int(self.L.llama_model_n_head_kv(self.model))
        head_dim = int(self.L.llama_model_n_embd(self.model)) // int(self.L.llama_model_n_head(self.model))
        return layers * 2 * heads_kv * head_dim * 2

    def allocate_kv(self, num_pages: int, page_size: int) -> None:
        raise TypeError("GgmlRunner owns its K/V: the engine calls allocate_streams (runner.OwnsKV)")

    def allocate_streams(self, num_pages: int, page_size: int, lanes: int, max_len: int, max_tokens: int) -> None:
        """Up to `lanes` streams of up to `max_len` tokens, launches of `max_tokens`: a first llama.cpp
        context of a few short streams, grown as launches need more (`_fit`)."""
        self.max_lanes, self.max_len = lanes, _aligned(max_len)
        self.page_size = page_size
        self.streams = [Stream() for _ in range(lanes)]
        self.page_gen = np.zeros(num_pages, dtype=np.int64)
        self.page_tokens = np.full((num_pages, page_size), -1, dtype=np.int32)
        self.stream_tokens = np.full((lanes, self.max_len), -1, dtype=np.int32)  # each stream's cells' tokens
        self.batch = self.L.llama_batch_init(max_tokens, 0, 1)
        self.capacity = max_tokens
        self.token_view = np.ctypeslib.as_array(self.batch.token, shape=(max_tokens,))
        self.pos_view = np.ctypeslib.as_array(self.batch.pos, shape=(max_tokens,))
        self.logit_flags = np.ctypeslib.as_array(self.batch.logits, shape=(max_tokens,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(max_tokens,))[:] = 1
        self.num_streams = self.stream_len = 0
        self.ctx = self._context(min(lanes, FIRST_STREAMS), min(self.max_len, FIRST_STREAM_LEN))
        self.memory = self.L.llama_get_memory(self.ctx)

    def _context(self, streams: int, per_stream: int) -> Any:
        """A llama.cpp context of `streams` streams of `per_stream` tokens (its K/V allocated and
        cleared now, which is why contexts start small)."""
        params = self.L.llama_context_default_params()
        params.n_ctx = per_stream * streams
        params.n_seq_max = streams
        params.kv_unified = False
        params.n_batch = self.capacity
        params.n_ubatch = min(self.capacity, 512)
        params.n_threads = params.n_threads_batch = self.threads
        # flash attention: a row's attention is then the same sum whatever else shares the launch
        # (without it, rows of unequal lengths in one launch round differently from a batch of one)
        params.flash_attn_type = self.L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        _errors.clear()
        ctx = self.L.llama_init_from_model(self.model, params)
        if not ctx:
            raise ModelLoadError(
                f"llama.cpp could not make a context of {streams} sequences of {per_stream} tokens "
                f"({_last_error()}); lower max_batch_size or max_model_len"
            )
        self.grown += 1
        self.num_streams, self.stream_len = streams, per_stream
        return ctx

    def _fit(self, lanes: np.ndarray, context: np.ndarray) -> None:
        """Make the context hold the launch: a stream for its highest lane, room for its longest row
        (`context`: each row's length after the launch). A larger context (at least twice the streams
        or the length it outgrows) takes over every stream's K/V (llama.cpp's per-sequence state:
        the same cells in the same order, so the same numerics); one that cannot be made fails the
        launch and keeps the old."""
        streams, length = int(lanes.max()) + 1, int(context.max())
        if streams <= self.num_streams and length <= self.stream_len:
            return
        if streams > self.max_lanes or length > self.max_len:
            raise RuntimeError(f"a launch needs lane {streams - 1} and {length} tokens, past the engine's limits")
        old, old_streams = self.ctx, self.num_streams
        if streams > old_streams:
            streams = min(self.max_lanes, max(streams, 2 * old_streams))
        if length > self.stream_len:
            length = min(self.max_len, max(_aligned(length), 2 * self.stream_len))
        states = [(lane, self._state(old, lane)) for lane in range(old_streams) if self.streams[lane].length]
        self.ctx = self._context(max(streams, old_streams), max(length, self.stream_len))
        self._views.clear()  # another context: other output buffers
        self.memory = self.L.llama_get_memory(self.ctx)
        self.L.llama_free(old)
        for lane, state in states:
            if not self._restore(lane, state, old_streams):  # computed again from the remembered tokens
                self.L.llama_memory_seq_rm(self.memory, lane, -1, -1)
                self.streams[lane] = Stream()

    def _state(self, ctx: Any, lane: int) -> bytes:
        size = self.L.llama_state_seq_get_size(ctx, lane)
        state = (ctypes.c_uint8 * size)()
        written = self.L.llama_state_seq_get_data(ctx, state, size, lane)
        return bytes(state)[:written]

    def _restore(self, lane: int, state: bytes, old_streams: int) -> bool:
        """Put a stream's state, saved from a context of `old_streams` streams, into this one. llama.cpp
        refuses a state of another stream count; it reads the streams' entries in turn and puts the
        one non-empty entry in the sequence's stream, so empty entries (a zero count) are added.
        A state of any other layout (another llama.cpp) is not restored: its stream is recomputed."""
        if len(state) < STATE_HEADER.size or STATE_HEADER.unpack_from(state)[1:] != (lane, old_streams):
            return False
        magic = STATE_HEADER.unpack_from(state)[0]
        moved = STATE_HEADER.pack(magic, lane, self.num_streams) + state[STATE_HEADER.size :]
        moved += bytes(4 * (self.num_streams - old_streams))
        buffer = (ctypes.c_uint8 * len(moved)).from_buffer_copy(moved)
        if not self.L.llama_state_seq_set_data(self.ctx, buffer, len(moved), lane):
            return False
        # the restored cells are the stream's positions 0 .. length - 1
        return int(self.L.llama_memory_seq_pos_max(self.memory, lane)) == self.streams[lane].length - 1

    def forward(self, batch: Any) -> torch.Tensor:
        assert batch.lanes is not None, "the engine gives an OwnsKV runner each row's lane"
        self.last_lanes = None
        if any(p is not None for p in batch.prefill):
            raise ValueError("the ggml runner runs text only: no image inputs")
        ids = batch.input_ids.numpy()
        starts = batch.query_start.numpy()
        context = batch.context_lens.numpy()
        tables = batch.block_tables.numpy()
        lanes = np.asarray(batch.lanes)
        self._fit(lanes, context)
        rows = len(context)
        plan: list[tuple[int, int, int]] = []  # (lane, first row, end row) per stream, in row order
        row = 0
        while row < rows:
            end = row + 1
            while end < rows and lanes[end] == lanes[row]:  # a verify step's positions
                end += 1
            plan.append((int(lanes[row]), row, end))
            row = end
        fills: list[Fill] = []
        held: dict[int, int] = {}  # the lanes prepared for this launch: what their memory holds until it runs
        for lane, first, end in plan:
            cached = int(context[first] - (starts[first + 1] - starts[first]))
            ends = [int(starts[r + 1] - starts[first]) for r in range(first, end)]
            fills.append(self._fill(lane, tables[first], cached, ids[starts[first] : starts[end]], ends, first, held))
        # lanes in increasing order: llama.cpp splits a batch over several streams into micro-batches
        # of consecutive sequence ids met in increasing order, each a pass over the weights
        logits = self._decode(sorted(fills, key=lambda fill: fill.lane))
        if len(plan) == rows:  # one sequence a row: a launch forward_next can continue
            self.last_lanes = [lane for lane, _, _ in plan]
            order = sorted(range(rows), key=self.last_lanes.__getitem__)
            self.last_order = None if order == list(range(rows)) else order
        return torch.from_numpy(logits)

    def forward_next(self, input_ids: np.ndarray, block_tables: np.ndarray) -> np.ndarray:
        """`runner.Continues`: the last launch's rows, each one token on. Their streams end where that
        launch left them (it made them agree with the rows' pages), so only the new token is noted and
        the batch is written in place (the rows' slots in lane order, as the launch before had them).
        The logits are a view of llama.cpp's output buffer where the rows were in lane order."""
        lanes, self.last_lanes = self.last_lanes, None
        if lanes is None or len(lanes) != len(input_ids):
            raise RuntimeError("forward_next continues a launch of one sequence a row, with the same rows")
        streams, size = self.streams, self.page_size
        positions = [streams[lane].length for lane in lanes]
        if max(positions) >= self.stream_len:
            self._fit(np.asarray(lanes), np.asarray(positions) + 1)
            if any(streams[lane].length != at for lane, at in zip(lanes, positions, strict=True)):
                # a stream the growth could not move: every row prepared as forward prepares one
                held: dict[int, int] = {}
                fills = [
                    self._fill(lane, block_tables[row], at, input_ids[row : row + 1], [1], row, held)
                    for row, (lane, at) in enumerate(zip(lanes, positions, strict=True))
                ]
                logits = self._decode(sorted(fills, key=lambda fill: fill.lane))
                self.last_lanes = lanes
                return logits
        b, rows = self.batch, len(lanes)
        for slot, row in enumerate(self.last_order or range(rows)):
            lane, position, token = lanes[row], positions[row], int(input_ids[row])
            page, cell = int(block_tables[row, position // size]), position % size
            if cell == 0:  # a page written from its first slot: a new generation (as _record)
                self.page_gen[page] += 1
                streams[lane].chain.append((page, int(self.page_gen[page])))
            self.page_tokens[page, cell] = self.stream_tokens[lane, position] = token
            streams[lane].length = position + 1
            self.token_view[slot], self.pos_view[slot] = token, position
            b.seq_id[slot][0] = lane
        self.logit_flags[:rows] = 1
        b.n_tokens = rows
        self._run(lanes, rows)
        out = self._outputs(rows)
        self.last_lanes = lanes
        return out if self.last_order is None else _in_row_order(out, self.last_order)

    def _fill(
        self, lane: int, table: np.ndarray, cached: int, query: np.ndarray, ends: list[int], first: int, held: dict[int, int]
    ) -> Fill:
        """One stream's part of a launch, its stream prepared and its tokens noted: `query` after the
        row's `cached` tokens, logits at each of its rows' query ends (`ends`: several for a verify
        row's positions), the launch's rows `first` on. `held`: as `_prepare`'s, updated."""
        # one row's query (a prompt chunk, a forced run): its first tokens may be in its stream already
        start, reused = self._prepare(lane, table, cached, held, query if len(ends) == 1 else None)
        held[lane] = start
        redo = self._tokens(table, start, cached)
        self.stats["recomputed"] += len(redo)
        tokens = np.concatenate([redo, query]).astype(np.int32)
        self._record(lane, table, start, cached, tokens)
        return Fill(lane, start + reused, tokens[reused:], [len(redo) + end - 1 - reused for end in ends], first)

    # ---- the mirror -----------------------------------------------------------------------------
    def _agreeing(self, stream: Stream, table: np.ndarray, cached: int) -> int:
        """How many of the row's cached tokens `stream` already holds."""
        pages = -(-cached // self.page_size)
        agree = 0
        for index, (page, gen) in enumerate(stream.chain[:pages]):
            if page != table[index] or gen != self.page_gen[page]:
                break
            agree = index + 1
        return min(stream.length, agree * self.page_size, cached)

    def _prepare(
        self, lane: int, table: np.ndarray, cached: int, held: dict[int, int], query: np.ndarray | None = None
    ) -> tuple[int, int]:
        """Make the lane's stream hold the longest prefix of the row's cached tokens that can be had
        without computing; returns its length (the position the row's launch starts at) and how many
        of the row's `query` tokens past it the stream holds already (`_reusable`). `held`: the
        streams this launch writes, already prepared, and what their memory holds before it runs (their
        chains already name the launch's pages, which a copy made now would not contain)."""
        stream = self.streams[lane]
        keep = self._agreeing(stream, table, cached)
        self.stats["kept"] += keep
        copied = False
        if keep < cached:
            donor, got = max(
                (
                    (d, self._agreeing(s, table, min(cached, held.get(d, cached))))
                    for d, s in enumerate(self.streams)
                    if d != lane
                ),
                key=lambda pair: pair[1],
                default=(None, 0),
            )
            got = (got // self.page_size) * self.page_size  # whole pages: a donor's last page may go on differently
            if donor is not None and got > keep:
                self.L.llama_memory_seq_rm(self.memory, lane, -1, -1)
                self.L.llama_memory_seq_cp(self.memory, donor, lane, -1, -1)
                self.stats["copied"] += got - keep
                keep = got
                stream.chain = list(self.streams[donor].chain)
                # what the copy holds for certain: a donor this launch writes held its `held` cells before
                # it (its length and tokens already count the query it is about to write); the memory
                # may hold more of the donor's, so the cells past the row's start are removed below
                stream.length = held.get(donor, self.streams[donor].length)
                self.stream_tokens[lane, : stream.length] = self.stream_tokens[donor, : stream.length]
                copied = True
        reused = self._reusable(lane, keep, query) if keep == cached and query is not None else 0
        self.stats["reused"] += reused
        if copied or stream.length > keep + reused:
            self.L.llama_memory_seq_rm(self.memory, lane, keep + reused, -1)
        stream.length = keep
        del stream.chain[-(-keep // self.page_size) :]
        return keep, reused

    def _reusable(self, lane: int, start: int, query: np.ndarray) -> int:
        """How many of a row's query tokens, from position `start` on, the lane's stream holds past its
        agreeing prefix: the same tokens after the same prefix, so the same K/V (a new prompt that
        goes on like the lane's previous one past their shared pages, as llama.cpp's completion API
        reuses its last prompt's). The query's last token is always computed: its logits are the row's."""
        held = self.streams[lane].length - start
        n = min(held, len(query) - 1)
        if n <= 0:
            return 0
        same = self.stream_tokens[lane, start : start + n] == query[:n]
        return n if bool(same.all()) else int(same.argmin())

    def _tokens(self, table: np.ndarray, start: int, end: int) -> np.ndarray:
        """The remembered tokens at positions start..end of the pages in `table`."""
        positions = np.arange(start, end)
        return self.page_tokens[table[positions // self.page_size], positions % self.page_size]

    def _record(self, lane: int, table: np.ndarray, start: int, cached: int, tokens: np.ndarray) -> None:
        """Note tokens written from `start` on: their pages' tokens, generations and the chain. Those
        before `cached` are the engine's cached tokens computed again: the same content, the same
        generation (other streams that hold those pages still agree)."""
        stream, size = self.streams[lane], self.page_size
        positions = np.arange(start, start + len(tokens))
        pages = table[positions // size]
        fresh = pages[(positions % size == 0) & (positions >= cached)]
        self.page_gen[fresh] += 1
        self.page_tokens[pages, positions % size] = tokens
        self.stream_tokens[lane, start : start + len(tokens)] = tokens
        stream.length = start + len(tokens)
        first = len(stream.chain)
        for index in range(first, -(-stream.length // size)):
            page = int(table[index])
            stream.chain.append((page, int(self.page_gen[page])))

    # ---- llama.cpp --------------------------------------------------------------------------------
    def _decode(self, fills: list[Fill]) -> np.ndarray:
        """One llama_decode of the fills; the logits of their offsets, in the rows' order."""
        total = sum(len(fill.tokens) for fill in fills)
        if total > self.capacity:
            raise RuntimeError(f"a launch of {total} tokens exceeds the ggml context's batch of {self.capacity}")
        b, n = self.batch, 0
        rows: list[int] = []  # the launch's row of each output, in batch order
        self.logit_flags[:total] = 0
        for fill in fills:
            count = len(fill.tokens)
            self.token_view[n : n + count] = fill.tokens
            self.pos_view[n : n + count] = np.arange(fill.start, fill.start + count)
            for index in range(n, n + count):
                b.seq_id[index][0] = fill.lane
            self.logit_flags[[n + o for o in fill.offsets]] = 1
            rows += range(fill.first_row, fill.first_row + len(fill.offsets))
            n += count
        b.n_tokens = n
        self._run([fill.lane for fill in fills], n)
        # llama_get_logits: the outputs' rows in batch order; copied while holding the GIL
        # (`_memmove`), so that the device thread does not wait for the scheduler's turn to take it
        # back between the launch and the sampling
        logits = np.empty((len(rows), self.vocab_size), dtype=np.float32)
        _memmove(logits.ctypes.data, self._outputs(len(rows)).ctypes.data, logits.nbytes)
        return logits if rows == sorted(rows) else _in_row_order(logits, rows)

    def _run(self, lanes: list[int], tokens: int) -> None:
        """llama_decode of the batch as written; a failure clears the streams it touched and raises."""
        status = self.L.llama_decode(self.ctx, self.batch)
        if status != 0:
            for lane in lanes:  # what the failed call left in these streams is unknown
                self.L.llama_memory_seq_rm(self.memory, lane, -1, -1)
                self.streams[lane] = Stream()
            raise RuntimeError(f"llama_decode failed with status {status} on a launch of {tokens} tokens: {_last_error()}")

    def _outputs(self, rows: int) -> np.ndarray:
        """The last launch's `rows` logit rows in batch order: a view of llama.cpp's output buffer,
        valid until the next launch (one view kept per buffer address and row count)."""
        address = ctypes.cast(self.L.llama_get_logits(self.ctx), ctypes.c_void_p).value
        if not address:
            raise RuntimeError("llama.cpp gave no logits for the launch")
        view = self._views.get((address, rows))
        if view is None:
            buffer = (ctypes.c_float * (rows * self.vocab_size)).from_address(address)
            view = self._views[(address, rows)] = np.ctypeslib.as_array(buffer).reshape(rows, self.vocab_size)
        return view

    # ---- what the user sees ---------------------------------------------------------------------------
    def describe(self) -> str:
        """Which runner and which kernels: llama.cpp's CPU features as its build reports them."""
        info = self.L.llama_print_system_info().decode()
        parts = info.replace("CPU :", "|").split("|")
        features = [part.split("=")[0].strip() for part in parts if part.strip().endswith("= 1")]
        version = getattr(self.L, "__version__", "?")
        return f"ggml (llama-cpp-python {version}, {self.threads} threads; CPU kernels: {' '.join(features)})"

    def close(self) -> None:
        if self.ctx:
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        if os is not None:  # not at interpreter teardown, when modules are gone
            with contextlib.suppress(Exception):
                self.close()


def _gil_memmove() -> Any:
    """libc's memmove called with the GIL held (ctypes.memmove drops and retakes it, and the thread
    may then wait for another's turn); ctypes.memmove where the C library cannot be opened so."""
    try:
        function = ctypes.PyDLL(None).memmove
    except (OSError, AttributeError):
        return ctypes.memmove
    function.restype = ctypes.c_void_p
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return function


_memmove = _gil_memmove()


def _in_row_order(logits: np.ndarray, rows: list[int]) -> np.ndarray:
    """Logits of a batch that went in lane order (`rows`: the launch's row of each), in the rows' order."""
    ordered = np.empty_like(logits)
    ordered[rows] = logits
    return ordered


def _aligned(tokens: int) -> int:
    return -(-tokens // STREAM_ALIGN) * STREAM_ALIGN


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


if __name__ == "__main__":  # python -m foveal.engine.models.ggml [--avx2]: CMAKE_ARGS for this machine
    import sys

    print(cmake_args(_cpu_flags(), avx512="--avx2" not in sys.argv[1:]))

