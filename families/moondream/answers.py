"""Moondream's decode rules as matchers the engine advances at commit: text answers and region answers.

PROBLEM
    Moondream's answers follow rules no grammar states. A caption or query answer may start with any
    token, but from its second token on the answer id is masked. A detect / point answer is not
    text at all: after the prompt the model decides, from one hidden state, whether to stop (eos)
    and where the next object's x is; then y; then (detect) its size; then again stop-or-x, at most
    `max_objects` times. Each decision is one step of the engine's pipeline.
SOLUTION
    `AnswerMatcher`: all tokens allowed at the first step, all but the answer id afterwards.
    `ReasoningMatcher`: a grounded reasoning (query with reasoning=True): every step is THINK, a
    token step whose coord token becomes a coordinate read from the same hidden state (the runner's
    sample_regions), so the next input is that coordinate's encoding; eos and size are masked from
    the second step on; the answer id ends the reasoning.
    `RegionMatcher`: an automaton over the step kinds GATE (token: eos ends the answer, anything
    else means "one more object", whose x the same step samples), COORD (y) and SIZE (w, h).
    Moondream 3 decides every gate after the first object on two rows of the lm_head only,
    [coord, eos] (`gate_ids`: the mask allows just those); the first gate, after the prompt, is
    the full argmax as in Moondream 2.
    Its `step_kind()` tells the engine what the next step samples (`foveal.engine.regions.RegionSteps`);
    `commit` reads the value id the sampler wrote (region.py) and moves on; eos or the
    `max_objects`-th object terminates it. Both fill their own masks (`fills_own_mask`,
    `foveal.engine.matcher.OwnMask`): they are not llguidance matchers, so the engine's pipeline
    calls their `fill_mask` itself and never hands them to the batched mask call. Both implement
    the engine's `Matcher` (commit, fill_mask, is_terminated), resolved once at submit.
INVARIANTS
    - A RegionMatcher refuses a value of the wrong kind (the engine then fails the request, not the batch).
    - After termination it refuses everything; `rollback(n)` undoes the last n commits exactly.
"""

from __future__ import annotations

import torch

from .region import value_of

GATE, COORD, SIZE, THINK = 1, 2, 3, 4  # engine step kinds (0 is a plain token step)


def _clear_bit(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Clear one token's bit of a row whose words are all ones."""
    _clear_bits(bitmask, row, (token,))


def _clear_bits(bitmask: torch.Tensor, row: int, tokens: tuple[int, ...]) -> None:
    """Clear these tokens' bits of a row whose words are all ones (tokens may share a word)."""
    words: dict[int, int] = {}
    for token in tokens:
        word, bit = divmod(token, 32)
        words[word] = words.get(word, 0xFFFFFFFF) & ~(1 << bit)
    for word, value in words.items():
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def _only_bits(bitmask: torch.Tensor, row: int, tokens: tuple[int, ...]) -> None:
    """Set a row to allow exactly these tokens."""
    bitmask[row] = 0
    words: dict[int, int] = {}
    for token in tokens:
        word, bit = divmod(token, 32)
        words[word] = words.get(word, 0) | (1 << bit)
    for word, value in words.items():
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


class AnswerMatcher:
    """Caption / query: the answer id is masked from the second step on (the reference's rule)."""

    fills_own_mask = True

    def __init__(self, answer_id: int) -> None:
        self.answer_id = answer_id
        self.steps = 0

    def commit(self, token_id: int) -> None:
        self.steps += 1

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1
        if self.steps:
            _clear_bit(bitmask, row, self.answer_id)

    def is_terminated(self) -> bool:
        return False

    def rollback(self, n: int) -> None:
        self.steps -= n


class ReasoningMatcher:
    """The reasoning phase of a grounded query: THINK steps until the answer id (the reference's loop)."""

    fills_own_mask = True

    def __init__(self, answer_id: int, masked: tuple[int, ...]) -> None:
        self.answer_id = answer_id
        self.masked = masked  # eos and size: masked after the first step, as the reference does
        self.history: list[int] = []

    def step_kind(self) -> int:
        return THINK

    def commit(self, token_id: int) -> None:
        if self.is_terminated():
            raise ValueError(f"the reasoning is complete; got {token_id}")
        self.history.append(token_id)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1
        if self.history:
            _clear_bits(bitmask, row, self.masked)

    def is_terminated(self) -> bool:
        return bool(self.history) and self.history[-1] == self.answer_id

    def rollback(self, n: int) -> None:
        if n:
            del self.history[-n:]


class RegionMatcher:
    """Detect (boxes: x, y, size) or point (x, y) answers, at most `max_objects` objects."""

    fills_own_mask = True

    def __init__(
        self, with_size: bool, max_objects: int, vocab_size: int, eos_id: int, gate_ids: tuple[int, ...] = ()
    ) -> None:
        self.with_size = with_size
        self.max_objects = max_objects
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.gate_ids = gate_ids  # the tokens a later gate may choose (Moondream 3); () for all
        self.history: list[int] = []
        self._replay()

    def _replay(self) -> None:
        self.kind, self.objects, self.done = GATE, 0, False
        for value in self.history:
            self._advance(value)

    def step_kind(self) -> int:
        return self.kind

    def commit(self, value_id: int) -> None:
        self._advance(value_id)
        self.history.append(value_id)

    def _advance(self, value_id: int) -> None:
        if self.done:
            raise ValueError(f"the answer is complete; got {value_id}")
        kind, _ = value_of(self.vocab_size, value_id)
        if self.kind == GATE and kind == "token" and value_id == self.eos_id:
            self.done = True
        elif self.kind == GATE and kind == "coord":
            self.kind = COORD
        elif self.kind == COORD and kind == "coord":
            self._object_done() if not self.with_size else setattr(self, "kind", SIZE)
        elif self.kind == SIZE and kind == "size":
            self._object_done()
        else:
            expected = {GATE: "eos or an x coordinate", COORD: "a y coordinate", SIZE: "a size"}[self.kind]
            raise ValueError(f"expected {expected}, got {kind} {value_id}")

    def _object_done(self) -> None:
        self.objects += 1
        self.kind = GATE
        self.done = self.objects >= self.max_objects

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.gate_ids and self.kind == GATE and self.objects:
            _only_bits(bitmask, row, self.gate_ids)
            return
        bitmask[row] = -1  # the stop-or-continue token is the plain argmax (nothing masked)

    def is_terminated(self) -> bool:
        return self.done

    def rollback(self, n: int) -> None:
        if n:
            del self.history[-n:]
            self._replay()
