"""Matcher: one sequence's state in an automaton; the protocol the engine calls on its hot path.

PROBLEM: the engine commits one sampled token per step and asks for the next mask while the
accelerator runs; every microsecond of Python here delays the pipeline, and a bad token must not
put the sequence into a state it cannot leave.
SOLUTION: a thin wrapper over one llguidance `LLMatcher` (compiled once per automaton, deep-copied
per sequence in ~5 µs). `commit` uses `try_consume_tokens`, which refuses a bad token without
entering llguidance's sticky error state, so `GrammarViolation` leaves the matcher unchanged. Masks
are written by pointer with the GIL released. It implements, structurally (this package imports no
other foveal package), the engine's `Matcher` and `ForcedTokens` protocols (foveal.engine.matcher;
tests/engine/test_protocols.py checks it): `commit`, `fill_mask`, `is_terminated`, and
`forced_tokens` / `ends_after` for jump-forward decoding.

Lexer fuel (why commit may compute a mask): llguidance builds its lexer DFA lazily, and that lexer is
shared by every deep copy of a template, i.e. by all matchers of one automaton. Building states costs
"fuel", which llguidance refills only when a mask is computed (`step_lexer_fuel`); commits draw on
what is left. A caller that commits many tokens without asking for masks therefore runs the shared
lexer dry, and an exhausted lexer enters a sticky error: `try_consume_tokens` then refuses tokens
(JSONSchemaBench Github_medium/o21115: a valid instance rejected at token 146), and every later
matcher of the automaton fails too. So `commit` computes the mask itself (into a throwaway buffer)
when none was computed since the last commit: a commit-only caller and a mask-then-commit caller
make the same native calls, and the engine, which always fills masks first, pays nothing. When the
shared lexer still hits a limit (one step genuinely too complex), the commit raises
GrammarLimitError and the automaton swaps in a freshly compiled template, so matchers created
afterwards start with a healthy lexer (matchers already running share the exhausted one and fail).
INVARIANTS:
1. After a refused commit the matcher is exactly as before (same mask, same count).
2. EOS is allowed by the mask exactly when the grammar accepts; committing EOS terminates.
3. `is_terminated()` is true once no token but EOS can follow (the output is complete) or EOS has
   been committed; the engine stops the request then. If llguidance stops on a resource limit
   mid-output, the next commit raises GrammarLimitError (a GrammarViolation) instead.
4. `rollback(n)` undoes exactly the last n commits, EOS included (llguidance does not count an EOS
   committed after the grammar stopped by itself, so the wrapper remembers that one).
5. A commit's verdict does not depend on whether the caller filled a mask before it.
6. A lexer limit hit by one matcher does not fail matchers created after it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import llguidance

from .bitmask import buffer_of, width_error
from .errors import GrammarLimitError, GrammarViolation, clean_native

if TYPE_CHECKING:
    from .automaton import Automaton


class Matcher:
    """State of one sequence; created by `Automaton.matcher()`."""

    __slots__ = ("automaton", "_ll", "_eos", "_words", "_count", "_eos_after_stop", "_fueled", "_origin")

    refines = False  # composite matchers narrow llguidance's mask after it is written

    def __init__(self, automaton: Automaton, ll: llguidance.LLMatcher) -> None:
        self.automaton = automaton
        self._ll = ll
        self._eos = automaton.tokenizer.eos_token_id
        self._words = automaton.tokenizer.mask_words
        self._count = 0
        self._eos_after_stop = False
        self._fueled = False  # a mask was computed since the last commit (llguidance refilled fuel)
        self._origin = automaton.template  # the template `ll` was copied from (see Automaton.renew_template)

    def commit(self, token_id: int) -> None:
        """Advance by one committed token; raise GrammarViolation (state unchanged) if not allowed."""
        if not self._fueled:
            self._ll.compute_bitmask()  # refills the shared lexer's fuel, as fill_mask does (see above)
        self._fueled = False
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
        error = self._ll.get_error() if self._ll.is_error() else self._refusal_reason(token_id)
        if error:
            if error.startswith("lexer error"):
                self.automaton.renew_template(self._origin)
            raise GrammarLimitError(
                token_id, self.automaton.tokenizer.token_text(token_id), error.splitlines()[0]
            )
        raise GrammarViolation(token_id, self.automaton.tokenizer.token_text(token_id))

    def _refusal_reason(self, token_id: int) -> str:
        """A resource-limit message if the refusal came from an exhausted lexer, else "".

        `try_consume_tokens` reports a lexer limit as a plain refusal and leaves the matcher out of
        the error state, while the shared lexer is left in its own; `consume_token` on a copy
        reports that state by name (refusal path only, never on the engine's hot path).
        """
        probe = self._ll.deep_copy()
        probe.consume_token(token_id)
        error = probe.get_error()
        return error if error.startswith("lexer error") else ""

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the allowed-token bits of the next step into `bitmask[row]`."""
        ptr, rows, words = buffer_of(bitmask)
        if words != self._words:
            raise width_error(words, self._words)
        if not 0 <= row < rows:
            raise IndexError(f"row {row} is outside the bitmask's {rows} rows")
        self._ll.unsafe_compute_mask_ptr(ptr + row * words * 4, words * 4)
        self._fueled = True
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

    def ends_after(self, tokens: list[int]) -> bool:
        """Whether committing `tokens` completes the output (the engine then launches nothing after
        them: pipeline.py, FINAL RUNS). Probed on a copy of the native matcher (tens of µs for a
        JSON answer's closing run); this matcher is unchanged. The probe walks only the forced run
        `forced_tokens()` just computed, whose lexer states exist already."""
        probe = self._ll.deep_copy()
        return probe.try_consume_tokens(tokens) == len(tokens) and probe.is_stopped() and not probe.is_error()

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
            raise RuntimeError(f"llguidance refused to roll back {native} tokens: {clean_native(self._ll.get_error())}")
        self._count -= n
        self._fueled = False

    def reset(self) -> None:
        self.rollback(self._count)
