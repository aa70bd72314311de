"""Boxes of decimal integers, `OPENING x1, y1, x2, y2]`, held to x1 < x2 <= width and y1 < y2 <= height.

A family whose answer writes a box as integers in a bracketed list (Qwen-VL's `"bbox_2d": [x1, y1,
x2, y2]`) has its Lark grammar enforce the shape and each field's own range (grammars/scalars.py
`int_range`), and this composite matcher enforce the order between fields. The family's spec
compiles with `matcher_class=IntegerBoxMatcher, extra=IntegerBoxes(integer_box_tables(handle),
width, height, opening)` (grammars.automaton `lark_automaton`).

PROBLEM: x2 > x1 and y2 > y1 relate two numbers that a context-free grammar cannot compare compactly
(bounded.py explains it for 3-decimal JSON numbers).
SOLUTION: the matcher refines the mask while x2 or y2 is written, from the committed text: with the
digits so far p and the bound (lo, hi] = (x1, width], a token whose bytes are digits d followed by
nothing may come if some integer in the range starts with p + d; digits d followed by other bytes
only if int(p + d) is in the range. Tokens are grouped by their leading digits once per tokenizer,
so a mask costs one pass over the groups (Qwen's tokenizer has one digit per token: 11 groups),
cached per (p, lo, hi). Inside a box's list, a token that holds digits after other bytes (`, 4`)
would start the next number unchecked; such tokens are refused there.
INVARIANTS (tests/grammars/test_grounding.py, through Qwen-VL's format):
1. Every answer a random walk under the mask reaches has every box x1 < x2 <= width, y1 < y2 <= height;
   the mask is never empty before termination.
2. commit() of a token that breaks a bound raises GrammarViolation and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance
import numpy as np

from .automaton import Automaton
from .bitmask import row_view
from .cache import LRUCache
from .errors import GrammarViolation
from .matcher import Matcher
from .tokenizer import TokenizerHandle

_DIGITS = frozenset(b"0123456789")
_SEPARATOR, _CLOSE = b", ", b"]"
_UNBOUNDED = 10**12  # x1, y1: their ranges are the grammar's; here only straddling tokens are refused


def _viable(prefix: str, lo: int, hi: int) -> bool:
    """Some integer in [lo, hi], written without leading zeros, starts with `prefix` (digits)."""
    if not prefix:
        return lo <= hi
    if prefix[0] == "0" and prefix != "0":
        return False
    if prefix == "0":
        return lo <= 0
    head = int(prefix)
    for extra in range(len(str(hi)) - len(prefix) + 1):
        first, last = head * 10**extra, (head + 1) * 10**extra - 1
        if first <= hi and last >= lo:
            return True
    return False


@dataclass(slots=True)
class IntegerBoxTables:
    """Per tokenizer: tokens grouped by their leading digits, and the cached refinement masks."""

    handle: TokenizerHandle
    token_bytes: list[bytes] = field(init=False)
    # (leading digits, more bytes after them) -> token ids
    groups: dict[tuple[str, bool], np.ndarray] = field(init=False)
    free: np.ndarray = field(init=False)  # every token but the straddling ones
    _masks: dict[tuple[str, int, int], np.ndarray] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.token_bytes = self.handle.token_bytes()
        groups: dict[tuple[str, bool], list[int]] = {}
        for token_id, data in enumerate(self.token_bytes):
            digits = len(data) - len(data.lstrip(b"0123456789"))
            rest = data[digits:]
            if any(b in _DIGITS for b in rest):
                continue  # digits after other bytes: refused inside a box (see the module docstring)
            groups.setdefault((data[:digits].decode(), bool(rest)), []).append(token_id)
        self.groups = {k: np.asarray(v, dtype=np.int64) for k, v in groups.items()}
        bits = np.zeros(self.handle.mask_words * 32, dtype=bool)
        for ids in self.groups.values():
            bits[ids] = True
        self.free = np.packbits(bits, bitorder="little").view(np.int32)

    def mask(self, partial: str, lo: int, hi: int) -> np.ndarray:
        """Allowed tokens while a number in [lo, hi] is written and `partial` holds its digits so far."""
        key = (partial, lo, hi)
        cached = self._masks.get(key)
        if cached is None:
            bits = np.zeros(self.handle.mask_words * 32, dtype=bool)
            for (digits, more), ids in self.groups.items():
                number = partial + digits
                if more:
                    ok = bool(number) and lo <= int(number) <= hi and _viable(number, lo, hi)
                else:
                    ok = _viable(number, lo, hi)
                if ok:
                    bits[ids] = True
            cached = np.packbits(bits, bitorder="little").view(np.int32)
            if len(self._masks) > 4096:
                self._masks.clear()
            self._masks[key] = cached
        return cached

    def allows(self, mask: np.ndarray, token_id: int) -> bool:
        return bool((int(mask[token_id >> 5]) >> (token_id & 31)) & 1)


# One table per tokenizer: Qwen2.5-VL compiles one automaton per resized image size, and grouping a
# 150k-token vocabulary takes longer than compiling the grammar.
_TABLES: LRUCache[IntegerBoxTables] = LRUCache(maxsize=16)


def integer_box_tables(handle: TokenizerHandle) -> IntegerBoxTables:
    tables = _TABLES.get(handle.key)
    if tables is None:
        tables = IntegerBoxTables(handle)
        _TABLES.put(handle.key, tables)
    return tables


@dataclass(frozen=True, slots=True)
class IntegerBoxes:
    """What an IntegerBoxMatcher reads (its automaton's `extra`): the tables, the scale, and the text
    that opens a box's list (ends with "[")."""

    tables: IntegerBoxTables
    width: int
    height: int
    opening: bytes


class IntegerBoxMatcher(Matcher):
    """Boxes as [x1, y1, x2, y2]: while x2 (y2) is written, its value is held in (x1, width] ((y1, height])."""

    __slots__ = ("_boxes", "_text", "_lengths")
    refines = True

    def __init__(self, automaton: Automaton, ll: llguidance.LLMatcher) -> None:
        super().__init__(automaton, ll)
        self._boxes: IntegerBoxes = automaton.extra
        self._text = bytearray()
        self._lengths: list[int] = []  # bytes each committed token added

    def _constraint(self) -> np.ndarray | None:
        """The refinement mask inside a box's list (None outside one)."""
        text, boxes = self._text, self._boxes
        start = text.rfind(boxes.opening)
        if start < 0:
            return None
        body = bytes(text[start + len(boxes.opening) :])
        if _CLOSE in body:
            return None
        fields = body.split(_SEPARATOR)
        partial = fields[-1]
        if partial and not partial.isdigit():  # a separator is being written: no number in progress
            return boxes.tables.free
        digits = partial.decode()
        if len(fields) == 3:
            return boxes.tables.mask(digits, int(fields[0]) + 1, boxes.width)
        if len(fields) == 4:
            return boxes.tables.mask(digits, int(fields[1]) + 1, boxes.height)
        return boxes.tables.mask(digits, 0, _UNBOUNDED)

    def commit(self, token_id: int) -> None:
        mask = self._constraint()
        tables = self._boxes.tables
        if mask is not None and not tables.allows(mask, token_id):
            raise GrammarViolation(
                token_id, self.automaton.tokenizer.token_text(token_id), "a box's max must exceed its min"
            )
        super().commit(token_id)
        data = tables.token_bytes[token_id] if token_id < len(tables.token_bytes) else b""
        self._text += data
        self._lengths.append(len(data))

    def forced_tokens(self) -> list[int]:
        """llguidance's forced tokens (jump-forward), cut before the first that holds a digit: llguidance
        does not know the x2 / y2 bounds (in practice no coordinate is forced: every range has several
        values; a digit in the label only loses its jump)."""
        forced = super().forced_tokens()
        texts = self._boxes.tables.token_bytes
        for index, token in enumerate(forced):
            if token >= len(texts) or _DIGITS.intersection(texts[token]):
                return forced[:index]
        return forced

    def _refine(self, ptr: int, row: int, words: int) -> None:
        mask = self._constraint()
        if mask is not None:
            row_view(ptr, row, words)[:] &= mask

    def rollback(self, n: int) -> None:
        super().rollback(n)
        for _ in range(n):
            cut = self._lengths.pop()
            if cut:
                del self._text[-cut:]
