"""torch's packed int4 weight layout, derived from torch's own converter on the CPU at hand.

PROBLEM
    `_weight_int4pack_mm_for_cpu` reads its weight in the layout that
    `_convert_weight_to_int4pack_for_cpu` writes, and that layout follows the vector kernels torch
    picked for this CPU: blocks of 64 rows under AVX-512, of 32 under AVX2, pairs of rows for a
    last partial block or without either. Code that packs, unpacks or concatenates packed weights
    itself (a GGUF load packs hundreds of layers; `quant.fuse_int4` joins q/k/v into one launch;
    `dequantize` reads the weights back) must hold on every CPU, including one whose layout nobody
    wrote down here.

SOLUTION
    Ask the converter. For a row count N, `layout(N)` runs it on tiny code matrices whose nibbles
    spell each row's index and each column's, and reads where every (row, column) nibble landed.
    Every layout torch writes is a nibble permutation of the form

        nibble index of (n, k) = start(n) * K + k * size(n) + slot(n)

    (rows grouped in blocks: a block starting at row start(n) of size(n) rows stores, column by
    column, one nibble per row at that row's slot; nibble 2i is byte i's low half). The three
    per-row numbers come from probes with K = 2 and K = 4, and the model is checked against the
    converter on a third K before it is used. Consecutive blocks of one size and slot order make a
    `Segment`, packed with a few vectorised ops (slices where the rows are evenly spaced, as in
    every layout torch writes; no per-element scatter). A row count whose layout
    does not fit the model gets None, and callers use the converter itself (`quant.pack_int4`).

INVARIANTS
    - `pack(codes)` equals the converter's output, byte for byte (tested on both CPU kinds: AVX2
      through ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine).
    - `unpack(pack(codes))` equals codes.
    - `joins(parts)`: the packed parts laid end to end are the packed concatenation exactly when it
      says so; otherwise the codes must be repacked for the joined row count.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

_CONVERT = torch.ops.aten._convert_weight_to_int4pack_for_cpu


@dataclass(frozen=True, slots=True)
class Segment:
    """`blocks` consecutive blocks of `size` rows from row `row`; for each column, byte j of a block
    holds its row `low[j]` in the low nibble and row `high[j]` in the high one."""

    row: int
    blocks: int
    size: int
    low: tuple[int, ...]
    high: tuple[int, ...]

    def rows(self, codes: torch.Tensor) -> torch.Tensor:
        """This segment's rows of [rows, K] as [blocks, size, K]."""
        return codes[self.row : self.row + self.blocks * self.size].view(self.blocks, self.size, -1)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where torch's converter puts each nibble of an [rows, K] int4 code matrix, for any even K."""

    rows: int
    segments: tuple[Segment, ...]

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """int4 codes [rows, K] (0..15, any integer dtype) -> uint8 [rows, K / 2], as the converter."""
        n, k = codes.shape
        if n != self.rows or k % 2:
            raise ValueError(f"a layout of {self.rows} rows packs [{self.rows}, even K] codes; got {n}x{k}")
        codes = codes.to(torch.uint8)
        out = torch.empty(n * k // 2, dtype=torch.uint8)
        for seg in self.segments:
            rows = seg.rows(codes)
            packed = rows[:, _index(seg.low)] | (rows[:, _index(seg.high)] << 4)  # [blocks, size / 2, K]
            at = seg.row * k // 2
            out[at : at + packed.numel()].view(seg.blocks, k, seg.size // 2).copy_(packed.transpose(1, 2))
        return out.view(n, k // 2)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """uint8 [rows, K / 2] in this layout -> the int4 codes [rows, K] as uint8."""
        n, half = packed.shape
        if n != self.rows:
            raise ValueError(f"a layout of {self.rows} rows unpacks [{self.rows}, K / 2] bytes; got {n}")
        k = 2 * half
        flat = packed.reshape(-1)
        codes = torch.empty(n, k, dtype=torch.uint8)
        for seg in self.segments:
            at = seg.row * half
            data = flat[at : at + seg.blocks * seg.size * half].view(seg.blocks, k, seg.size // 2)
            data = data.transpose(1, 2)  # [blocks, size / 2, K]
            rows = seg.rows(codes)
            rows[:, _index(seg.low)] = data & 0x0F
            rows[:, _index(seg.high)] = data >> 4
        return codes


def joins(parts: list[int]) -> bool:
    """Whether packed weights of `parts` rows each, laid end to end, are the packing of their
    concatenation: every part's blocks are the joined layout's blocks, shifted by the rows before it."""
    joined = layout(sum(parts))
    if joined is None:
        return False
    expected: list[Segment] = []
    row = 0
    for n in parts:
        own = layout(n)
        if own is None:
            return False
        expected += [Segment(s.row + row, s.blocks, s.size, s.low, s.high) for s in own.segments]
        row += n
    return _merged(expected) == joined.segments


@cache
def layout(rows: int) -> Layout | None:
    """The converter's layout for `rows` output features on this CPU, or None where it does not fit
    the block model (then the converter itself packs). Cached per row count; a few microsecond
    converter calls on [rows, <= 6] probes."""
    if rows <= 0 or rows % 16:
        return None
    where = {k: _positions(rows, k) for k in (2, 4)}
    size = where[2][:, 1] - where[2][:, 0]
    start2 = where[4][:, 0] - where[2][:, 0]  # 2 * start
    if bool((start2 % 2).any()):
        return None
    start = start2 // 2
    slot = where[2][:, 0] - 2 * start
    candidate = _segments(start.tolist(), size.tolist(), slot.tolist())
    if candidate is None:
        return None
    found = Layout(rows, candidate)
    probe = torch.randint(0, 16, (rows, 6), dtype=torch.int32, generator=torch.Generator().manual_seed(rows))
    if not torch.equal(found.pack(probe), _CONVERT(probe, 1)):
        return None
    return found


def _positions(rows: int, k: int) -> torch.Tensor:
    """[rows, k]: the nibble index at which the converter stores each (row, column)."""
    digits = max(1, (max(rows, k) - 1).bit_length() + 3) // 4  # base-16 digits of the largest index
    n = torch.arange(rows, dtype=torch.int64)[:, None].expand(rows, k)
    col = torch.arange(k, dtype=torch.int64)[None, :].expand(rows, k)
    source_row = torch.zeros(rows * k, dtype=torch.int64)
    source_col = torch.zeros(rows * k, dtype=torch.int64)
    for digit in range(digits):
        for index, out in ((n, source_row), (col, source_col)):
            spelled = ((index >> (4 * digit)) & 15).to(torch.int32).contiguous()
            out += _nibbles(_CONVERT(spelled, 1)).to(torch.int64) << (4 * digit)
    where = torch.full((rows, k), -1, dtype=torch.int64)
    where[source_row, source_col] = torch.arange(rows * k, dtype=torch.int64)
    return where


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1)
    return torch.stack([flat & 0x0F, flat >> 4], dim=-1).reshape(-1)


def _segments(start: list[int], size: list[int], slot: list[int]) -> tuple[Segment, ...] | None:
    """Blocks from per-row numbers, merged into segments; None if the rows do not form blocks."""
    blocks: list[Segment] = []
    row = 0
    while row < len(start):
        n = size[row]
        if n <= 0 or n % 2 or start[row] != row or row + n > len(start):
            return None
        members = range(row, row + n)
        if any(start[r] != row or size[r] != n for r in members):
            return None
        order = [-1] * n
        for r in members:
            if not 0 <= slot[r] < n or order[slot[r]] != -1:
                return None
            order[slot[r]] = r - row
        blocks.append(Segment(row, 1, n, tuple(order[0::2]), tuple(order[1::2])))
        row += n
    return _merged(blocks)


def _merged(blocks: list[Segment]) -> tuple[Segment, ...]:
    merged: list[Segment] = []
    for seg in blocks:
        last = merged[-1] if merged else None
        if (
            last is not None
            and (last.size, last.low, last.high) == (seg.size, seg.low, seg.high)
            and last.row + last.blocks * last.size == seg.row
        ):
            merged[-1] = Segment(last.row, last.blocks + seg.blocks, last.size, last.low, last.high)
        else:
            merged.append(seg)
    return tuple(merged)


def _index(rows: tuple[int, ...]) -> slice | list[int]:
    """A slice where the rows are evenly spaced (every layout torch writes: a view, no gather)."""
    step = rows[1] - rows[0] if len(rows) > 1 else 1
    if step > 0 and all(b - a == step for a, b in zip(rows, rows[1:], strict=False)):
        return slice(rows[0], rows[-1] + 1, step)
    return list(rows)
