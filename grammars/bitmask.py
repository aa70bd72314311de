"""Token bitmasks: the int32 `(rows, ceil(V/32))` buffers masks are written into, and the executor.

Executor threads: llguidance's `LLExecutor` fills a batch on its own thread pool. The engine's device
thread runs the forward at the same time, so every mask thread competes with it for a core. The
pool size is `mask_threads()`: `set_mask_threads(n)` if called, else the environment variable
`FOVEAL_MASK_THREADS`, else `default_mask_threads()`: one core left to the device thread, at most
4, at least 1. A fill is about a hundredth of a forward, and where cores are few a second
executor thread fills no faster while it slows the forward beside it (benchmarks/grammar_layer.py
--contention measures both; docs/performance.md has the figures), so two cores get one thread. The
cap of 4 for larger machines is a guess, not a measurement.

Bit `t % 32` of word `t // 32` in a row is set when token `t` is allowed. Buffers may be numpy
arrays or CPU torch tensors (pinned or not); llguidance writes into them by raw pointer with the GIL
released, so each must be int32, 2-D and C-contiguous, and its row width must equal the automaton's
`ceil(vocab_size / 32)` exactly (the model's vocabulary, not the tokenizer's).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import llguidance
import numpy as np


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A zeroed int32 bitmask for `rows` sequences over a vocabulary of `vocab_size` ids."""
    return np.zeros((rows, (vocab_size + 31) // 32), dtype=np.int32)


def buffer_of(bitmask: Any) -> tuple[int, int, int]:
    """(base pointer, rows, words per row) of a bitmask, after checking it can be written."""
    iface = getattr(bitmask, "__array_interface__", None)
    if iface is not None:
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags.c_contiguous:
            raise ValueError("bitmask must be a C-contiguous 2-D int32 array (rows, ceil(V/32))")
        rows, words = bitmask.shape
        return iface["data"][0], rows, words
    if hasattr(bitmask, "data_ptr"):
        if (
            str(bitmask.dtype) != "torch.int32"
            or bitmask.dim() != 2
            or not bitmask.is_contiguous()
            or bitmask.device.type != "cpu"
        ):
            raise ValueError(
                "bitmask must be a contiguous 2-D int32 CPU tensor (rows, ceil(V/32)); "
                "fill on the host, then copy to the device"
            )
        rows, words = bitmask.shape
        return bitmask.data_ptr(), rows, words
    raise TypeError(f"bitmask must be a numpy array or a torch tensor, got {type(bitmask).__name__}")


def width_error(words: int, expected: int) -> ValueError:
    return ValueError(
        f"bitmask rows have {words} int32 words but the automaton was compiled for {expected} "
        f"(ceil(vocab_size/32)); compile with vocab_size=<the model's vocabulary size>"
    )


def row_view(ptr: int, row: int, words: int) -> np.ndarray:
    """A numpy view of one row of any CPU bitmask buffer (for the composite matchers' AND step)."""
    return np.ctypeslib.as_array((ctypes.c_int32 * words).from_address(ptr + row * words * 4))


ENV_MASK_THREADS = "FOVEAL_MASK_THREADS"
_chosen_threads: int | None = None  # set_mask_threads(); None: environment or default


def default_mask_threads(cores: int | None = None) -> int:
    """One core left to the device thread, at most 4 threads, at least 1 (see the module docstring)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores - 1, 4))


def mask_threads() -> int:
    """The executor's thread count: set_mask_threads(), else $FOVEAL_MASK_THREADS, else the default."""
    if _chosen_threads is not None:
        return _chosen_threads
    value = os.environ.get(ENV_MASK_THREADS)
    return default_mask_threads() if value is None else _checked_threads(value, ENV_MASK_THREADS)


def set_mask_threads(n: int | None) -> None:
    """Use n threads for batched mask fills from now on (None: back to environment/default)."""
    global _chosen_threads
    _chosen_threads = None if n is None else _checked_threads(n, "set_mask_threads")


def _checked_threads(value: Any, source: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(value).strip() != str(n):
        raise ValueError(f"{source}={value!r}: the number of mask threads must be a whole number >= 1")
    return n


def executor() -> llguidance.LLExecutor:
    """The process-wide llguidance thread pool for batched mask fills, of mask_threads() threads."""
    return _executor(mask_threads())


@functools.cache
def _executor(threads: int) -> llguidance.LLExecutor:
    return llguidance.LLExecutor(num_threads=threads)


def allowed_tokens(bitmask: Any, row: int = 0) -> np.ndarray:
    """Token ids whose bit is set in one row (for tests, walks and debugging; not the hot path)."""
    ptr, _, words = buffer_of(bitmask)
    return np.flatnonzero(np.unpackbits(row_view(ptr, row, words).view(np.uint8), bitorder="little"))


def is_allowed(bitmask: Any, token_id: int, row: int = 0) -> bool:
    ptr, _, words = buffer_of(bitmask)
    return bool((int(row_view(ptr, row, words)[token_id // 32]) >> (token_id % 32)) & 1)
