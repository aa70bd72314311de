"""Random walks under the mask: the generation-soundness probe of the conformance runner and tests.

A walk starts a matcher, and at every step picks a token uniformly among the allowed ones, with a
pull towards closing that grows with length (EOS when allowed, else a token made only of `"`, `]`,
`}`), so walks over unbounded grammars end. Whatever a walk emits is something a model sampling
under the mask could emit, so a walk's text failing validation is a soundness bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .automaton import Automaton
from .bitmask import allocate_bitmask, allowed_tokens
from .errors import GrammarLimitError


@dataclass(slots=True)
class Walk:
    tokens: list[int]  # committed tokens, EOS excluded
    terminated: bool  # reached termination (complete output) before max_tokens
    empty_mask: bool  # the mask allowed nothing before termination (a dead end: always a bug)
    limit: str = ""  # llguidance stopped on a resource limit mid-output (GrammarLimitError)


_CLOSERS: dict[str, np.ndarray] = {}


def closing_tokens(automaton: Automaton) -> np.ndarray:
    """Boolean array over the vocabulary: tokens made only of closing characters `"]}`."""
    handle = automaton.tokenizer
    cached = _CLOSERS.get(handle.key)
    if cached is None:
        closing = set(b'"]}')
        flags = [bool(b) and set(b) <= closing for b in handle.token_bytes()]
        cached = np.zeros(handle.vocab_size, dtype=bool)
        cached[: len(flags)] = flags
        _CLOSERS[handle.key] = cached
    return cached


def random_walk(
    automaton: Automaton, rng: np.random.Generator, *, max_tokens: int = 2000, pull: float = 0.01
) -> Walk:
    """One walk; at step i the pull towards closing has probability min(0.95, pull * i)."""
    matcher = automaton.matcher()
    eos = automaton.tokenizer.eos_token_id
    closers = closing_tokens(automaton)
    bitmask = allocate_bitmask(1, automaton.vocab_size)
    tokens: list[int] = []
    for step in range(max_tokens):
        if matcher.is_terminated():
            return Walk(tokens, True, False)
        matcher.fill_mask(bitmask, 0)
        allowed = allowed_tokens(bitmask, 0)
        if len(allowed) == 0:
            return Walk(tokens, False, True)
        token = int(rng.choice(allowed))
        if rng.random() < min(0.95, pull * step):
            closing = allowed[closers[allowed]]
            if eos in allowed:
                token = eos
            elif len(closing):
                token = int(rng.choice(closing))
        try:
            matcher.commit(token)
        except GrammarLimitError as err:
            return Walk(tokens, False, False, str(err))
        if token == eos:
            return Walk(tokens, True, False)
        tokens.append(token)
    return Walk(tokens, matcher.is_terminated(), False)
