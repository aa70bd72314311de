"""`DecodeGraphs`: decode launches replayed as TorchScript graphs, one native call per forward.

PROBLEM
    On CPU the engine's device thread runs forwards while the main thread does bookkeeping. An
    eager transformers forward is hundreds of small Python-dispatched ops; it re-takes the GIL
    between them, so the two threads serialise (docs/architecture.md, "The engine"), and for
    small models the Python overhead is most of the step.

SOLUTION
    The CPU twin of CUDA-graph replay: the eager decode forward is traced with `torch.jit.trace`
    once per rows bucket (num_seqs padded up to the next 2^k or 3 * 2^k: `bucket`) and replayed;
    the TorchScript interpreter runs the whole step without the GIL. The block table's width (in
    pages, padded to its bucket too) reaches the forward as a traced shape, not a host int, so one
    graph serves every width and a call's growing context never waits for a new trace. The rows
    are fixed by the trace, so a batch is padded into its bucket: padding rows decode token 0 at
    position 0 into the runner's scratch page (never one of the engine's), and their logits are
    dropped. Prefill (variable query lengths, images) stays eager. Buckets named in `prepare` are
    traced in the background as soon as the runner allocates its KV (a fresh process's first
    calls then replay graphs instead of running eager), and a trace scripts only the step, not
    the model's module tree (what made a trace of a 30-layer model take seconds).

INVARIANTS
    - A replay gives the same logits as the eager forward on the same batch, at every table width
      (tests/models/test_traced.py; per family through multi-step greedy parity, where every
      decode launch is a replay).
    - Padding rows write only the scratch page (and the sliding pool's: engine/sliding.py); real
      rows' KV indices are the batch's own.
    - The KV tensors are inputs of the graph, never constants baked into it, so replays write the
      live cache. A trace made in the background runs on an all-padding batch: it writes only the
      scratch page, which no real row reads unmasked.
    - A runner's graphs die with it (`own_compilation_unit`): nothing traced here stays in torch's
      process-wide TorchScript unit, which is never emptied. A trace holds the model's weights as
      constants (sharing the parameters' storage) and its executor's plans, so a trace kept there
      would keep the weights of every model loaded, called and closed (tests/engine/test_leaks.py
      checks it; benchmarks/leaks.py measures the memory of load / call / close cycles).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.jit._state

from foveal.engine.models.attention import PagedKV
from foveal.engine.runner import ForwardBatch

# A trace warns where foveal's modules, or the transformers modules it traces (families without a
# lean forward), read a traced shape as a Python value (a bucket's rows are fixed: intended), and
# torch.jit.trace warns that it is deprecated. Each trace adds filters for exactly those
# (`hide_trace_warnings`), in front of the process's others and leaving them as they are: traces
# run on a background thread, where warnings.catch_warnings would swap the process's filters
# (silencing every thread's warnings while a trace runs, dropping filters other code set
# meanwhile). They are added at each trace, not once at import, since an import inside a
# catch_warnings block (pytest's collection is one) would lose them.
TRACE_WARNINGS: tuple[dict[str, Any], ...] = (
    {"category": torch.jit.TracerWarning, "module": r"(foveal|transformers)\."},
    {"category": DeprecationWarning, "module": r"torch\.jit\._trace", "message": r"`torch\.jit\.trace"},
)


def hide_trace_warnings() -> None:
    """Put TRACE_WARNINGS' filters in front of the process's (once each: filterwarnings moves an
    existing identical filter instead of adding another)."""
    for spec in TRACE_WARNINGS:
        warnings.filterwarnings("ignore", **spec)


def bucket(n: int) -> int:
    """The smallest 2^k or 3 * 2^k that holds n: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... A bucket
    is less than 1.5 n (powers of two alone: up to 2 n), for twice the traces."""
    power = 1 << max(0, n - 1).bit_length()
    return power * 3 // 4 if power >= 4 and n <= power * 3 // 4 else power


_unit_lock = threading.Lock()  # the swap below is process-wide: one trace at a time swaps it


@contextlib.contextmanager
def own_compilation_unit() -> Iterator[torch.jit.CompilationUnit]:
    """Make what is traced inside the block live in a fresh TorchScript compilation unit.

    `torch.jit.trace` registers each traced module's type and methods (their graphs, constants and
    optimized plans) in `torch.jit._state._python_cu`, a process-wide unit nothing ever empties;
    its `_compilation_unit` argument is ignored for modules. torch's C++ side looks the unit up as
    that Python attribute at each use, so swapping the attribute for the duration of the trace puts
    the trace in a unit of its own, which the traced module keeps alive and frees with itself.
    Traces here take turns (the lock); a TorchScript compile on another thread during the swap
    would land in this unit too, which is harmless: its module keeps the unit alive as well.
    """
    with _unit_lock:
        saved = torch.jit._state._python_cu
        unit = torch.jit._state._python_cu = torch.jit.CompilationUnit()
        try:
            yield unit
        finally:
            torch.jit._state._python_cu = saved


def script_objects(model: torch.nn.Module | None) -> list[torch.ScriptObject]:
    """The TorchScript objects held as attributes of the model's modules, each once."""
    found: dict[int, torch.ScriptObject] = {}
    for module in [] if model is None else model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.ScriptObject):
                found.setdefault(id(value), value)
    return list(found.values())


def _replay(graph: torch.jit.ScriptModule, args: tuple) -> torch.Tensor:
    with torch.jit.optimized_execution(False):  # thread-local: this replay only
        return graph(*args)


class _Step(torch.nn.Module):
    """The traced unit: batch tensors and KV tensors in, last-token logits out."""

    def __init__(
        self,
        eager: Callable[[ForwardBatch, list, list], torch.Tensor],
        page_size: int,
        model: torch.nn.Module | None,
    ) -> None:
        super().__init__()
        self.eager = eager
        self.page_size = page_size
        # The TorchScript objects the model's modules hold (quant.HalfLinear's fbgemm packs), as
        # attributes of this module: a trace records only objects of its own module tree. The model
        # itself is not a submodule: scripting its few hundred modules was most of a trace's time.
        for index, packed in enumerate(script_objects(model)):
            setattr(self, f"packed_{index}", packed)

    def forward(self, input_ids, positions, query_start, context_lens, block_tables, kv_index, ks, vs):
        return self.eager(self.batch(input_ids, positions, query_start, context_lens, block_tables, kv_index), list(ks), list(vs))

    def batch(self, input_ids, positions, query_start, context_lens, block_tables, kv_index) -> ForwardBatch:
        # Read from the table's shape, not a host int: under the tracer a shape is a traced value,
        # so the graph's key count follows the width of the table it is given (any width).
        max_context_len = block_tables.shape[1] * self.page_size
        return ForwardBatch(input_ids, positions, query_start, context_lens, block_tables, kv_index, 1, max_context_len)


class _SlidingStep(_Step):
    """The traced unit of a runner with a sliding-window page pool: its tables and KV indices are inputs too."""

    def forward(  # type: ignore[override]  # its graph's inputs: two more than a _Step's; never called as one
        self, input_ids, positions, query_start, context_lens, block_tables, kv_index, ks, vs, sliding_tables,
        sliding_kv_index,
    ):
        batch = self.batch(input_ids, positions, query_start, context_lens, block_tables, kv_index)
        batch.sliding_block_tables, batch.sliding_kv_index = sliding_tables, sliding_kv_index
        return self.eager(batch, list(ks), list(vs))


class DecodeGraphs:
    """Pads a decode batch into its bucket and replays that bucket's graph, tracing it on first use.

    One graph serves every width of its rows bucket: the trace reads the table's width as a traced
    shape, so a call that meets a new (rows, width) bucket reuses the rows bucket's graph (`graphs`
    lists every bucket met, several naming one graph). Graphs are replayed with TorchScript's
    optimizing passes off: they bought nothing measurable for these graphs and cost two slow replays
    (a profiling run and an optimization) after every trace.

    `background=True`: a rows bucket seen for the first time runs eager, and its graph is traced on
    a thread of its own from an all-padding batch (every row in the scratch page), to be replayed
    once ready. Tracing a deep model takes seconds, many decode steps' worth, and a batch that met
    a new bucket would stall every request in it for that long; in the background it costs eager
    steps instead, not much slower than replays. `background=False` traces in the launch itself.

    `kv` and `prepare`: where the runner's KV tensors are (a callable returning its `PagedKV`) and
    the rows buckets to trace as soon as they exist: `clear()`, which the runner calls when it
    allocates its KV, starts those traces in the background, so that the first calls find their
    graphs ready (a fresh process's first calls are otherwise eager).
    """

    def __init__(
        self,
        eager: Callable[[ForwardBatch, list, list], torch.Tensor],
        model: torch.nn.Module | None = None,
        background: bool = True,
        kv: Callable[[], PagedKV | None] | None = None,
        prepare: tuple[int, ...] = (),
    ) -> None:
        self.eager = eager
        self.model = model
        self.graphs: dict[tuple[int, int], torch.jit.ScriptModule] = {}
        self._by_rows: dict[int, torch.jit.ScriptModule] = {}  # one width-generic graph per rows bucket
        self._pending: dict[int, Future] = {}
        self._tracer = (
            ThreadPoolExecutor(1, thread_name_prefix="foveal-trace") if background or prepare else None
        )
        self._background = background
        self._generation = 0  # bumped by clear(): a trace of an older KV cache is dropped
        self._kv = kv
        self.prepare = tuple(bucket(rows) for rows in prepare)

    def __call__(
        self, batch: ForwardBatch, ks: list, vs: list, page_size: int, scratch_page: int, sliding_scratch: int = -1
    ) -> torch.Tensor:
        """Replay (or trace) the decode launch `batch`; `sliding_scratch`: the scratch page of the
        runner's sliding-window pool, when the batch has its tables (engine/sliding.py)."""
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        key = (bucket(n), bucket(width))
        args = (*self._pad(batch, *key, page_size, scratch_page), tuple(ks), tuple(vs))
        if batch.sliding_block_tables is not None:
            assert batch.sliding_kv_index is not None  # set with the sliding tables
            tables = self._pad_tables(batch.sliding_block_tables, *key, sliding_scratch)
            args = (*args, tables, self._grow(batch.sliding_kv_index, key[0] - n, sliding_scratch * page_size))
        graph = self.graphs.get(key) or self._by_rows.get(key[0])
        if graph is None and not self._background:
            graph = self._by_rows[key[0]] = self._trace(args, page_size)
        elif graph is None:
            self._trace_later(key, args, page_size, scratch_page, sliding_scratch)
            return self.eager(batch, ks, vs)
        self.graphs[key] = graph
        return _replay(graph, args)[:n]

    def clear(self) -> None:
        """Forget every graph (the KV tensors they were traced with are gone), then start the
        traces of the `prepare` buckets on the runner's current KV tensors, if it has them."""
        self._generation += 1
        self.graphs.clear()
        self._by_rows.clear()
        self._pending.clear()
        kv = self._kv() if self._kv is not None else None
        if kv is None:
            return
        for rows in self.prepare:
            args = self._idle_batch(rows, kv)
            self._trace_later((rows, 1), args, kv.page_size, kv.scratch_page, kv.sliding_scratch_page)

    def wait(self) -> None:
        """Block until the traces started so far have ended (each holds the runner, hence the
        weights, while it runs); a trace that failed says so at the next launch of its bucket."""
        futures.wait(list(self._pending.values()))

    def _trace_later(
        self, key: tuple[int, int], args: tuple, page_size: int, scratch_page: int, sliding_scratch: int = -1
    ) -> None:
        rows = key[0]
        started = self._pending.get(rows)
        if started is not None:
            if started.done() and started.exception() is not None:
                raise RuntimeError(f"tracing the decode step of {rows} rows failed") from started.exception()
            return
        idle = self._idle_args(args, page_size, scratch_page, sliding_scratch)
        generation = self._generation

        def trace() -> None:
            with torch.inference_mode():
                graph = self._trace(idle, page_size)
                _replay(graph, idle)  # a graph's first run is slower than the others: not in a call
            if generation == self._generation:
                self._by_rows[rows] = graph
                self.graphs[key] = graph

        assert self._tracer is not None  # made for background traces and `prepare`, the callers of this
        self._pending[rows] = self._tracer.submit(trace)

    def _trace(self, args: tuple, page_size: int) -> torch.jit.ScriptModule:
        hide_trace_warnings()
        with own_compilation_unit():
            step = (_SlidingStep if len(args) > 8 else _Step)(self.eager, page_size, self.model)
            return torch.jit.trace(step, args, check_trace=False)

    @staticmethod
    def _idle_batch(rows: int, kv: PagedKV) -> tuple:
        """Inputs of a decode launch of `rows` padding rows on the KV tensors `kv`."""
        device = kv.k[0].device

        def scratch(page: int) -> tuple[torch.Tensor, torch.Tensor]:  # a table and KV indices in `page`
            table = torch.full((rows, 1), page, dtype=torch.int32, device=device)
            return table, torch.full((rows,), page * kv.page_size, dtype=torch.int64, device=device)

        args = (
            torch.zeros(rows, dtype=torch.int64, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
            torch.arange(rows + 1, dtype=torch.int32, device=device),
            torch.ones(rows, dtype=torch.int32, device=device),
            *scratch(kv.scratch_page),
            tuple(kv.k),
            tuple(kv.v),
        )
        return (*args, *scratch(kv.sliding_scratch_page)) if kv.sliding else args

    @staticmethod
    def _idle_args(args: tuple, page_size: int, scratch_page: int, sliding_scratch: int = -1) -> tuple:
        """The bucket's inputs with every row a padding row (token 0 at position 0, keys and values
        in the scratch pages only): a trace run beside the live forwards touches no engine page."""
        input_ids, positions, query_start, context_lens, tables, kv_index, ks, vs = args[:8]

        def scratch(tables: torch.Tensor, kv_index: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
            tables = torch.full_like(tables, -1)
            tables[:, 0] = page
            return tables, torch.full_like(kv_index, page * page_size)

        idle = (
            torch.zeros_like(input_ids),
            torch.zeros_like(positions),
            query_start.clone(),
            torch.ones_like(context_lens),
            *scratch(tables, kv_index, scratch_page),
            ks,
            vs,
        )
        # the sliding pool's (tables, kv_index)
        return (*idle, *scratch(args[8], args[9], sliding_scratch)) if len(args) > 8 else idle

    @classmethod
    def _pad(cls, batch: ForwardBatch, rows: int, cols: int, page_size: int, scratch_page: int) -> tuple:
        extra = rows - batch.num_seqs
        return (
            cls._grow(batch.input_ids, extra, 0),
            cls._grow(batch.positions, extra, 0),
            torch.arange(rows + 1, dtype=batch.query_start.dtype, device=batch.input_ids.device),
            cls._grow(batch.context_lens, extra, 1),
            cls._pad_tables(batch.block_tables, rows, cols, scratch_page),
            cls._grow(batch.kv_index, extra, scratch_page * page_size),
        )

    @staticmethod
    def _grow(t: torch.Tensor, extra: int, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((extra,), value)]) if extra else t

    @staticmethod
    def _pad_tables(tables: torch.Tensor, rows: int, cols: int, scratch_page: int) -> torch.Tensor:
        """`tables` padded to `cols` pages with -1 and to `rows` rows of padding rows (the scratch page)."""
        n, width = tables.shape
        if cols > width:
            tables = torch.cat([tables, tables.new_full((n, cols - width), -1)], dim=1)
        if rows > n:
            pad = tables.new_full((rows - n, cols), -1)
            pad[:, 0] = scratch_page
            tables = torch.cat([tables, pad])
        return tables
