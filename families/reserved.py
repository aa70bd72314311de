"""Free text that never holds a family's reserved tokens.

PROBLEM
    Some vocabularies hold tokens that mean something only inside one answer format: PaliGemma's
    `<locNNNN>` and `<segNNN>` (the embedded model's too). Every grammar already excludes them
    (foveal's tokenizer handle flags them special), but an answer decoded without a grammar (a
    caption, a query, chat text) can sample them, and they then leak into the text:
    `'<loc0017><loc0020> circle'` as the answer to "describe the shapes".
SOLUTION
    A family names its reserved tokens (`Family.reserved_token_ids`); its free-text requests decode
    under `ReservedTokens`, a matcher whose mask is every token but those, one constant row built
    once per family (`ReservedMask`) and copied into the step's mask (`OwnMask`: no native call, no
    grammar state). It commits anything else, rolls back trivially (drafts still work) and never
    ends the answer itself: EOS, stop strings and max_tokens end it as for any free text.
INVARIANTS (tests/families/test_reserved.py)
    - No reserved token is ever sampled in free text, greedy or sampled.
    - Every other token stays allowed: where the unconstrained answer held no reserved token, the
      greedy answer is the same token for token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

PALIGEMMA_RESERVED = re.compile(r"<loc\d{4}>|<seg\d{3}>")  # PaliGemma's location and segmentation tokens


def reserved_ids(tokenizer, pattern: re.Pattern) -> tuple[int, ...]:
    """Ids of the tokenizer's added tokens whose whole text matches `pattern`."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return tuple(sorted(i for i, token in added.items() if pattern.fullmatch(str(getattr(token, "content", token)))))


class ReservedMask:
    """The constant mask row of a vocabulary with `ids` disallowed; `matcher()` is one request's view."""

    def __init__(self, vocab_size: int, ids: Iterable[int]) -> None:
        words = (vocab_size + 31) // 32
        row = torch.full((words,), -1, dtype=torch.int32)
        for i in ids:
            if not 0 <= i < vocab_size:
                raise ValueError(f"reserved token {i} is outside the vocabulary of {vocab_size}")
            row[i // 32] &= ~(1 << (i % 32)) if i % 32 != 31 else 0x7FFFFFFF
        self.row = row
        self.ids = frozenset(ids)

    def matcher(self) -> ReservedTokens:
        return ReservedTokens(self)


class ReservedTokens:
    """A free-text request's matcher: every token but the reserved ones (the module docstring)."""

    fills_own_mask = True

    def __init__(self, mask: ReservedMask) -> None:
        self.mask = mask

    def commit(self, token_id: int) -> None:
        if token_id in self.mask.ids:
            raise ValueError(f"token {token_id} is reserved for this model's answer formats")

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.mask.row)

    def is_terminated(self) -> bool:
        return False

    def rollback(self, n: int) -> None:
        """Nothing to undo: the mask never changes."""
