"""Matcher: one sequence's state in an automaton; the protocol the engine calls on its hot path.

PROBLEM: the engine commits one sampled token per step and asks for the next mask while the
accelerator runs; every microsecond of Python here delays the pipeline, and a bad token must not
put the sequence into a state it cannot leave.
SOLUTION: a thin wrapper over one llguidance `LLMatcher` (compiled once per automaton, deep-copied
per sequence in ~5 µs). `commit` uses `try_consume_tokens`, which refuses a bad token without
entering llguidance's sticky error state, so `GrammarViolation` leaves the matcher unchanged. Masks
are written by pointer with the GIL released.
INVARIANTS:
1. After a refused commit the matcher is exactly as before (same mask, same count).
2. EOS is allowed by the mask exactly when the grammar accepts; committing EOS terminates.
3. `is_terminated()` is true once no token but EOS can follow (the output is complete) or EOS has
   been committed; the engine stops the request then. If llguidance stops on a resource limit
   mid-output, the next commit raises GrammarLimitError (a GrammarViolation) instead.
4. `rollback(n)` undoes exactly the last n commits, EOS included (llguidance does not count an EOS
   committed after the grammar stopped by itself, so the wrapper remembers that one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import llguidance

from .bitmask import buffer_of, width_error
from .errors import GrammarLimitError, GrammarViolation

if TYPE_CHECKING:
    from .automaton import Automaton


class Matcher:
    """State of one sequence; created by `Automaton.matcher()`."""

    __slots__ = ("automaton", "_ll", "_eos", "_words", "_count", "_eos_after_stop")

    refines = False  # composite matchers narrow llguidance's mask after it is written

    def __init__(self, automaton: Automaton, ll: llguidance.LLMatcher) -> None:
        self.automaton = automaton
        self._ll = ll
        self._eos = automaton.tokenizer.eos_token_id
        self._words = automaton.tokenizer.mask_words
        self._count = 0
        self._eos_after_stop = False

    def commit(self, token_id: int) -> None:
        """Advance by one committed token; raise GrammarViolation (state unchanged) if not allowed."""
        if self._ll.try_consume_tokens([token_id]) == 1:
            self._count += 1
            return
        if (
            token_id == self._eos
            and not self._eos_after_stop
            and self._ll.is_stopped()
            and not self._ll.is_error()
        ):
            self._eos_after_stop = True
            self._count += 1
            return
        if self._ll.is_error():
            error = self._ll.get_error()
            raise GrammarLimitError(
                token_id, self.automaton.tokenizer.token_text(token_id), error.splitlines()[0]
            )
        raise GrammarViolation(token_id, self.automaton.tokenizer.token_text(token_id))

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the allowed-token bits of the next step into `bitmask[row]`."""
        ptr, rows, words = buffer_of(bitmask)
        if words != self._words:
            raise width_error(words, self._words)
        if not 0 <= row < rows:
            raise IndexError(f"row {row} is outside the bitmask's {rows} rows")
        self._ll.unsafe_compute_mask_ptr(ptr + row * words * 4, words * 4)
        if self.refines:
            self._refine(ptr, row, words)

    def _refine(self, ptr: int, row: int, words: int) -> None:
        """Composite matchers clear further bits of a freshly written row; plain ones do nothing."""

    def is_terminated(self) -> bool:
        # An errored llguidance matcher is "stopped" too; that is not a finished output (see commit).
        return self._ll.is_stopped() and not self._ll.is_error()

    def is_accepting(self) -> bool:
        """True when the output so far is complete (EOS is allowed now)."""
        return self._ll.is_accepting()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (jump-forward); empty when there is a choice."""
        return self._ll.compute_ff_tokens()

    def forced_text(self) -> bytes:
        return self._ll.compute_ff_bytes()

    @property
    def num_committed(self) -> int:
        return self._count

    def rollback(self, n: int) -> None:
        """Undo the last n commits."""
        if not 0 <= n <= self._count:
            raise ValueError(f"cannot roll back {n} tokens: {self._count} are committed")
        native = n
        if n and self._eos_after_stop:
            self._eos_after_stop = False
            native -= 1
        if native and not self._ll.rollback(native):
            raise RuntimeError(f"llguidance refused to roll back {native} tokens: {self._ll.get_error()}")
        self._count -= n

    def reset(self) -> None:
        self.rollback(self._count)
