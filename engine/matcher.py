"""The engine's view of a grammar: the `Matcher` protocol and how a step's masks are filled.

The engine depends on `foveal.grammars` only through this protocol (DESIGN.md, "Layout"). A matcher
is one sequence's state in a token-mask automaton; the engine advances it at commit and asks it
for the next token's mask at finalize. A matcher may also offer `forced_tokens() -> list[int]`,
the tokens its grammar forces next (empty when there is a choice); jump-forward decoding
(pipeline.py) uses it where present, and every token it returns must be committable in order.
Such a matcher may also offer `ends_after(tokens) -> bool`: whether committing those tokens
completes the output, without changing the matcher; a forced run that does gets no launch after it.

Masks are int32 bitmasks of shape (rows, ceil(V / 32)); bit j of word i set means token 32 * i + j
is allowed. A whole step's masks are filled by one `FillMasks` call: `foveal.grammars.fill_masks`
is one native call for all rows (a call per row would hand the GIL back and forth, see
measurements.md); `fill_masks_each` is the row-by-row version for matchers without a batched path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Matcher(Protocol):
    def commit(self, token_id: int) -> None:
        """Advance by one committed token; raise if the token is not allowed."""
        ...

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit set = allowed)."""
        ...

    def is_terminated(self) -> bool: ...

    def rollback(self, n: int) -> None: ...


FillMasks = Callable[[Sequence[Matcher], torch.Tensor], None]


def fill_masks_each(matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
    """Fill row i of `bitmask` from `matchers[i]`, one call per matcher."""
    for row, matcher in enumerate(matchers):
        matcher.fill_mask(bitmask, row)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
