"""Composite matchers that keep every emitted box geometrically valid: x_min < x_max, y_min < y_max.

PROBLEM: the box fields cross (x_min, y_min, x_max, y_max; loc order y_min x_min y_max x_max), so
the constraint "max > min" needs two remembered values at once. A CFG would have to enumerate every
(x_min, y_min) pair (10^6 states for 3-decimal JSON numbers): not compact, slow to compile.
SOLUTION: llguidance enforces the shape (a Lark grammar, spatial.py); a per-field lower bound is
learned at commit time and applied on top of llguidance's mask:
- loc tokens: a coordinate is exactly one token, so the bound is an extra precomputed token mask
  ("loc bins > k", built once per k and cached in the automaton) ANDed into the row.
- JSON: a number spans several tokens and tokens can straddle its end (`5,`), so a token mask per
  bound is not enough. When x_min (y_min) is complete, a second llguidance matcher starts at that
  token boundary with the cached sub-grammar `[^x]*"x_max": GT(x_min)[,}].*` (`GT(v)`: a regex of
  the 3-decimal numbers in (v, 1], built digit by digit). Its mask is ANDed into the row and it
  must accept every committed token until x_max is complete, then it is dropped. The `[^x]*` prefix
  pins it to this box's x_max (y: `[^y]*"y_max"`, which no key in between contains).
Cost: pure llguidance except on box rows inside a coordinate; there one numpy AND per row (and one
extra llguidance mask per active sub-matcher for JSON). fill_masks stays one native call for all rows.
INVARIANTS (tests/grammars/test_spatial.py):
1. Every output a random walk under the mask reaches is a valid shape with x_min < x_max and
   y_min < y_max for every box, and the mask is never empty before termination.
2. commit() of a token that would break the bound raises GrammarViolation and changes nothing.
3. rollback(n) restores exactly the state after the earlier commit (same masks).
4. GT(v) accepts exactly the 3-decimal numbers greater than v.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import llguidance
import numpy as np

from .bitmask import row_view
from .errors import GrammarViolation, clean_native
from .matcher import Matcher
from .tokenizer import TokenizerHandle


def digits_at_least(lo: int, width: int) -> str | None:
    """Regex of the `width`-digit strings whose value is >= lo (None if there is none)."""
    if lo <= 0:
        return f"[0-9]{{{width}}}"
    if lo >= 10**width:
        return None
    if width == 1:
        return f"[{lo}-9]"
    head, rest = divmod(lo, 10 ** (width - 1))
    alternatives = []
    if head < 9:
        alternatives.append(f"[{head + 1}-9][0-9]{{{width - 1}}}")
    tail = digits_at_least(rest, width - 1)
    if tail is not None:
        alternatives.append(f"{head}{tail}")
    return "(" + "|".join(alternatives) + ")"


def greater_than(thousandths: int) -> str:
    """Regex of the numbers in (v, 1] with at most 3 decimals, v = thousandths / 1000."""
    alternatives = [r"1(\.0{1,3})?"]
    for width in (1, 2, 3):
        scale = 10 ** (3 - width)  # "0.d" stands for d * 100 thousandths, "0.dd" for dd * 10
        lo = -(-(thousandths + 1) // scale)
        digits = digits_at_least(lo, width)
        if digits is not None:
            alternatives.append(rf"0\.{digits}")
    return "(" + "|".join(alternatives) + ")"


def thousandths(number: bytes) -> int:
    return round(float(number) * 1000)


# ---- location tokens -------------------------------------------------------------------------


@dataclass(slots=True)
class LocBoxTables:
    """Per automaton: token id -> bin, and the cached masks "every token except loc bins <= k"."""

    handle: TokenizerHandle
    ids: list[int]
    bin_of: dict[int, int] = field(init=False)
    _above: dict[int, np.ndarray] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.bin_of = {token_id: k for k, token_id in enumerate(self.ids)}

    def above(self, k: int) -> np.ndarray:
        mask = self._above.get(k)
        if mask is None:
            mask = np.full(self.handle.mask_words, -1, dtype=np.int32)
            banned = np.asarray(self.ids[: k + 1], dtype=np.int64)
            bits = np.zeros(self.handle.mask_words * 32, dtype=bool)
            bits[banned] = True
            mask &= ~np.packbits(bits, bitorder="little").view(np.int32)
            self._above[k] = mask
        return mask


class LocBoxMatcher(Matcher):
    """Box items as 4 loc tokens (y_min x_min y_max x_max): the 3rd and 4th must exceed the 1st and 2nd."""

    __slots__ = ("_tables", "_bins", "_kinds")
    refines = True

    def __init__(self, automaton, ll: llguidance.LLMatcher) -> None:
        super().__init__(automaton, ll)
        self._tables: LocBoxTables = automaton.extra
        self._bins: list[int] = []  # bins of the committed loc tokens, in order
        self._kinds: list[bool] = []  # per committed token: was it a loc token

    def _bound(self) -> int | None:
        """The bin the next loc token must exceed, if the next coordinate is a max."""
        return self._bins[-2] if len(self._bins) % 4 >= 2 else None

    def commit(self, token_id: int) -> None:
        k = self._tables.bin_of.get(token_id)
        if k is not None:
            bound = self._bound()
            if bound is not None and k <= bound:
                raise GrammarViolation(
                    token_id,
                    self.automaton.tokenizer.token_text(token_id),
                    f"a box's max bin must exceed its min bin {bound}",
                )
        super().commit(token_id)
        self._kinds.append(k is not None)
        if k is not None:
            self._bins.append(k)

    def forced_tokens(self) -> list[int]:
        """llguidance's forced tokens up to the first loc token (whose bound llguidance does not know)."""
        forced = super().forced_tokens()
        for index, token in enumerate(forced):
            if token in self._tables.bin_of:
                return forced[:index]
        return forced

    def _refine(self, ptr: int, row: int, words: int) -> None:
        bound = self._bound()
        if bound is not None:
            row_view(ptr, row, words)[:] &= self._tables.above(bound)

    def rollback(self, n: int) -> None:
        super().rollback(n)
        for _ in range(n):
            if self._kinds.pop():
                self._bins.pop()


# ---- JSON ------------------------------------------------------------------------------------

_KEYS = (b'"x_min": ', b'"y_min": ', b'"x_max": ', b'"y_max": ')
_NUMBER_BYTES = frozenset(b"0123456789.")


@dataclass(slots=True)
class JsonBoxTables:
    """Per automaton: token bytes and the cached sub-grammar templates, one per (axis, bound)."""

    handle: TokenizerHandle
    token_bytes: list[bytes] = field(init=False)
    _subs: dict[tuple[str, int], llguidance.LLMatcher] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.token_bytes = self.handle.token_bytes()

    def sub_matcher(self, axis: str, bound: int) -> llguidance.LLMatcher:
        template = self._subs.get((axis, bound))
        if template is None:
            regex = rf'[^{axis}]*"{axis}_max": {greater_than(bound)}[,}}][\s\S]*'
            template = llguidance.LLMatcher(
                self.handle.ll, llguidance.LLMatcher.grammar_from_regex(regex), log_level=0
            )
            if template.is_error():  # a bug in greater_than, never user input
                raise RuntimeError(f"bound sub-grammar failed to compile: {clean_native(template.get_error())}")
            self._subs[(axis, bound)] = template
        return template.deep_copy()


class JsonBoxMatcher(Matcher):
    """JSON boxes: while x_max (y_max) is being written, a sub-matcher holds it above x_min (y_min)."""

    __slots__ = ("_tables", "_tokens", "_text", "_pos", "_phase", "_subs", "_scratch")
    refines = True

    def __init__(self, automaton, ll: llguidance.LLMatcher) -> None:
        super().__init__(automaton, ll)
        self._tables: JsonBoxTables = automaton.extra
        self._tokens: list[int] = []
        self._scratch = np.empty(self._words, dtype=np.int32)
        self._restart()

    def forced_tokens(self) -> list[int]:
        """llguidance's forced tokens, cut where a live bound sub-matcher stops accepting them."""
        forced = super().forced_tokens()
        for sub in self._subs.values():
            forced = forced[: sub.validate_tokens(forced)] if forced else forced
        return forced

    def _restart(self) -> None:
        self._text = bytearray()
        self._pos = 0
        self._phase = 0  # which key's value completes next: x_min, y_min, x_max, y_max
        self._subs: dict[str, llguidance.LLMatcher] = {}

    def commit(self, token_id: int) -> None:
        for sub in self._subs.values():
            if sub.validate_tokens([token_id]) != 1:
                raise GrammarViolation(
                    token_id, self.automaton.tokenizer.token_text(token_id), "a box's max must exceed its min"
                )
        super().commit(token_id)
        self._follow(token_id)
        self._tokens.append(token_id)

    def _follow(self, token_id: int) -> None:
        for sub in self._subs.values():
            sub.consume_token(token_id)
        self._text += self._tables.token_bytes[token_id]
        self._scan()

    def _scan(self) -> None:
        """Advance over every coordinate value completed by the text so far."""
        text = self._text
        while True:
            key = _KEYS[self._phase]
            start = text.find(key, self._pos)
            if start < 0:
                return
            end = start + len(key)
            while end < len(text) and text[end] in _NUMBER_BYTES:
                end += 1
            if end == len(text):
                return  # the number may still grow
            value = thousandths(bytes(text[start + len(key) : end]))
            self._pos = end
            if self._phase < 2:
                axis = "x" if self._phase == 0 else "y"
                self._subs[axis] = self._tables.sub_matcher(axis, value)
            else:
                del self._subs["x" if self._phase == 2 else "y"]
            self._phase = (self._phase + 1) % 4

    def _refine(self, ptr: int, row: int, words: int) -> None:
        if not self._subs:
            return
        view = row_view(ptr, row, words)
        scratch = self._scratch
        for sub in self._subs.values():
            sub.unsafe_compute_mask_ptr(scratch.ctypes.data, words * 4)
            view &= scratch

    def rollback(self, n: int) -> None:
        super().rollback(n)
        # Rare (speculative decoding): rebuild the bookkeeping by replaying the kept tokens.
        kept = self._tokens[: len(self._tokens) - n]
        self._tokens = kept
        self._restart()
        for token_id in kept:
            self._follow(token_id)
