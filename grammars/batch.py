"""`fill_masks(matchers, bitmask)`: the masks of a whole decoding step in one native call.

The engine calls this once per step with the matchers of the constrained rows. llguidance's
executor computes all rows on its thread pool with the GIL released, so the engine's other threads
keep running; a per-row Python loop of native calls would hand the GIL back and forth instead.
Rows without a matcher (None, or absent from a mapping) are left untouched. Composite (spatial)
matchers narrow their rows afterwards with a numpy AND.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .bitmask import buffer_of, executor, width_error
from .matcher import Matcher


def fill_masks(matchers: Sequence[Matcher | None] | Mapping[int, Matcher], bitmask: Any) -> None:
    """Fill `bitmask[row]` for each matcher: entry i of a sequence is row i; a mapping maps row -> matcher."""
    ptr, rows, words = buffer_of(bitmask)
    items = matchers.items() if isinstance(matchers, Mapping) else enumerate(matchers)
    pairs = []
    filled = []
    composites = []
    for row, m in items:
        if m is None:
            continue
        if m._words != words:
            raise width_error(words, m._words)
        if not 0 <= row < rows:
            raise IndexError(f"row {row} is outside the bitmask's {rows} rows")
        pairs.append((m._ll, row))
        filled.append(m)
        if m.refines:
            composites.append((m, row))
    if not pairs:
        return
    executor().unsafe_compute_mask_ptr(pairs, ptr, words * 4, rows)
    for m in filled:
        m._fueled = True  # llguidance refilled each lexer's fuel (see matcher.py)
    for m, row in composites:
        m._refine(ptr, row, words)
