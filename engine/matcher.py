"""The engine's view of a grammar: what it calls on a matcher, declared as protocols, and how a step's masks are filled.

PROBLEM
    The engine depends on `foveal.grammars` only through what it calls on a matcher (docs/architecture.md,
    "The grammars"), and some matchers can do more than others: a grammar may know the tokens it forces
    next, a family's own automaton may fill its mask in Python rather than through the batched
    native call. Probing for such extras on the step loop costs host time every step, and a
    matcher that lacks a required method would fail deep inside a step instead of at submit.
SOLUTION
    Each capability is a `Protocol` here (and `regions.RegionSteps` for non-token steps):
      - `Matcher` (required): `commit`, `fill_mask`, `is_terminated`.
      - `Rollback` (speculative decoding, pipeline.py): `rollback(n)` undoes the last n commits.
        Drafts are probed, and the masks of their positions filled, by committing them tentatively
        and rolling back; a matcher without it gets no drafts (foveal.grammars' matchers have it).
      - `ForcedTokens` (jump-forward, pipeline.py): `forced_tokens()` and `ends_after(tokens)`.
      - `OwnMask`: `fills_own_mask = True`, a matcher whose `fill_mask` is its own code rather
        than a native matcher the step's `FillMasks` understands; the pipeline fills its row by
        calling `fill_mask` and hands only the other rows to `FillMasks`.
    A request's matcher is checked against `Matcher` at submit (`require`: a TypeError naming
    what is missing) and its optional capabilities are resolved once, into the sequence's record
    (sequence.Sequence); the step loop reads that record, never the matcher's attributes.
    `missing` / `conforms` / `require` are how every engine protocol is checked (matchers here,
    runners in runner.py and regions.py, devices in device.py): a method must be callable, a data
    member present.

Masks are int32 bitmasks of shape (rows, ceil(V / 32)); bit j of word i set means token 32 * i + j
is allowed. A whole step's masks are filled by one `FillMasks` call: `foveal.grammars.fill_masks`
is one native call for all rows (a call per row would hand the GIL back and forth); `fill_masks_each`
is the row-by-row version for matchers without a batched path.
INVARIANTS
    - Every token `forced_tokens()` returns is committable in order; it is empty when there is a
      choice. `ends_after(tokens)` changes nothing and says whether committing `tokens` completes
      the output; a matcher that cannot tell says False (the run is then carried as a jump).
    - A `FillMasks` call writes row i of `bitmask` from `matchers[i]` and touches no other row.
    - `rollback(n)` after n commits leaves the matcher as it was before them (same masks, same verdicts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import torch
from typing_extensions import get_protocol_members


@runtime_checkable
class Matcher(Protocol):
    """One sequence's state in a token-mask automaton: advanced at commit, asked for masks at finalize."""

    def commit(self, token_id: int) -> None:
        """Advance by one committed token; raise if the token is not allowed (the request then fails)."""
        ...

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit set = allowed); touch no other row."""
        ...

    def is_terminated(self) -> bool:
        """True once the output is complete: the engine finishes the request (STOP) after this commit."""
        ...


@runtime_checkable
class ForcedTokens(Protocol):
    """A matcher that knows what its grammar forces next (jump-forward, pipeline.py)."""

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces from the current state, in order; [] when there is a choice."""
        ...

    def ends_after(self, tokens: list[int]) -> bool:
        """Whether committing `tokens` (a prefix of `forced_tokens()`) completes the output; changes
        nothing. False when the matcher cannot tell."""
        ...


@runtime_checkable
class Rollback(Protocol):
    """A matcher that can undo commits: speculative decoding probes drafts with it (pipeline.py)."""

    def rollback(self, n: int) -> None:
        """Undo the last `n` commits."""
        ...


@runtime_checkable
class OwnMask(Protocol):
    """A matcher whose `fill_mask` is its own code: `fills_own_mask = True` (a class attribute).

    The step's `FillMasks` (foveal.grammars.fill_masks, say) is then never handed this matcher;
    the pipeline calls its `fill_mask` for its row."""

    fills_own_mask: bool


FillMasks = Callable[[Sequence[Matcher], torch.Tensor], None]


def fill_masks_each(matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
    """Fill row i of `bitmask` from `matchers[i]`, one call per matcher."""
    for row, matcher in enumerate(matchers):
        matcher.fill_mask(bitmask, row)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


# ---- checking an object against a protocol (once, where it enters the engine) ------------------------------


@functools.cache
def _members(protocol: type) -> tuple[tuple[str, bool], ...]:
    """(name, is_method) for each member of `protocol`, sorted by name."""
    return tuple(
        (name, callable(getattr(protocol, name, None))) for name in sorted(get_protocol_members(protocol))
    )


def missing(obj: Any, protocol: type) -> list[str]:
    """The members of `protocol` that `obj` lacks: an absent attribute, or a method that is not callable."""
    absent = object()
    lacking = []
    for name, is_method in _members(protocol):
        value = getattr(obj, name, absent)  # a declared member, looked up once where obj enters the engine
        if value is absent or (is_method and not callable(value)):
            lacking.append(name)
    return lacking


P = TypeVar("P")


def conforms(obj: Any, protocol: type[P]) -> TypeGuard[P]:
    """Whether `obj` has every member of `protocol` (so the checker narrows `obj` to it where true)."""
    return not missing(obj, protocol)


def require(obj: Any, protocol: type, role: str, where: str) -> None:
    """Raise TypeError naming what `obj` lacks of `protocol`; `where` names the module stating the contract."""
    lacking = missing(obj, protocol)
    if lacking:
        raise TypeError(
            f"the {role} {type(obj).__name__} does not implement {protocol.__name__}: it lacks "
            f"{', '.join(lacking)}; implement {'it' if len(lacking) == 1 else 'them'} as {where} states"
        )


def own_mask(matcher: Matcher) -> bool:
    """Whether the pipeline fills `matcher`'s rows itself (`OwnMask` with a true `fills_own_mask`)."""
    return conforms(matcher, OwnMask) and bool(matcher.fills_own_mask)
