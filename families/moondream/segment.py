"""Moondream 3's segment answer as an automaton: the object's centre and size from the region heads,
then the SVG path its text tokens spell, read token by token.

PROBLEM
    A segment answer (the moondream3-tiny fixture's README, "Kestrel differences") is region steps
    first, a coordinate x, a coordinate y and a size (w, h): the object's box; then text tokens
    (ids > 20) each of which, decoded alone and stripped, is a piece of an SVG path on the 960
    viewbox (a command letter, "-" negating the next integer, an integer), until eos. Three things
    a plain text answer does not give:
    - the region steps must be decoded in the pipeline (the runner's COORD / SIZE steps, as detect's);
    - the path must parse: a token that is no path piece, or one that breaks the path's syntax (a
      number before the first command, a command before the last one has all its numbers, eos in
      the middle of a command's numbers), must never be sampled;
    - the path is read from the tokens one at a time, so token boundaries count: two integer tokens
      "12" and "34" are two numbers, but a byte-level tokenizer decodes them together as "1234".
      The answer's decoded text loses what the path needs.
SOLUTION
    `PathTokens` (one per family, built on first use): every id > 20 whose text (decoded alone,
    stripped) is a path piece, with its items (commands, "-", integers; "M12" is two), and, for each
    syntax state reached, the tokens allowed there and the state each leads to (cached: the states
    are few). A state is (a command seen, the current command's arity, numbers its group still
    needs, a "-" waiting for its integer).
    `SegmentMatcher` (one per call): steps 0 and 1 are COORD steps, step 2 a SIZE step (the runner
    samples the heads' argmax from the same hidden state, as detect's region steps); then token
    steps masked to the path tokens the state allows, plus eos where the path is complete. It keeps
    the committed region values and path items, which is where the call's value is read from
    (`value`): the box from the first centre and size (`bbox_from_region`, clamped), the path from
    the items of complete command groups (an answer cut by max_tokens keeps the groups it finished,
    as Moondream's engine does), written by `PathWriter` (normalized by 1/960, 3 decimals).
    Reading the matcher's items rather than the text is how token boundaries are kept (see
    family3.Moondream3Family.prepare: the call's parse, progress and read are bound to its matcher /
    its output's token ids).
INVARIANTS (tests/models/moondream/test_md3_segment.py)
    - Every committed answer's path parses; eos is allowed only at a group boundary after >= 1 command.
    - The path `value` gives only grows as tokens are committed (a stream's chunks join to the end's).
    - A token of the wrong kind is refused (ValueError); `rollback(n)` undoes the last n commits.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from foveal.vision.svg import ARITY, SvgPathError

from .answers import COORD, SIZE, _only_bits
from .region import coord_from_bin, size_from_bins, value_of
from .svg import PathWriter, bbox_from_region, path_items, path_piece

TEXT_IDS_FROM = 21  # ids <= 20 are Moondream's special and control ids, never part of a path
TOKEN = 0
START = (False, 0, 0, False)  # (a command seen, its arity, numbers its group still needs, "-" waiting)
State = tuple[bool, int, int, bool]


def advance(state: State, items: list[str]) -> State | None:
    """The syntax state after these path items, or None where they break the path's syntax."""
    started, arity, need, negate = state
    for item in items:
        if item == "-":
            if negate or not started or (need == 0 and arity == 0):
                return None
            negate, need = True, need or arity  # a "-" may open the command's next group
        elif item.isdigit():
            if not started or (need == 0 and arity == 0):
                return None
            need = (need or arity) - 1
            negate = False
        else:
            if negate or need or (not started and item not in "Mm"):
                return None
            started, arity, need = True, ARITY[item.upper()], ARITY[item.upper()]
    return started, arity, need, negate


def complete(state: State) -> bool:
    """Whether a path may end in this state: a command seen, its numbers all given, no "-" waiting."""
    started, _, need, negate = state
    return started and need == 0 and not negate


class PathTokens:
    """The tokens that spell path pieces, and which of them each syntax state allows (cached)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_id: int) -> None:
        self.vocab_size, self.eos_id = vocab_size, eos_id
        ids = list(range(TEXT_IDS_FROM, min(vocab_size, len(tokenizer))))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # one native call: each id decoded alone, as Moondream's engine does
            texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=True)
        else:
            texts = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
        self.items: dict[int, list[str]] = {
            i: path_items(text) for i, text in zip(ids, texts, strict=True) if path_piece(text)
        }
        self._states: dict[State, tuple[tuple[int, ...], dict[int, State]]] = {}
        self._rows: dict[tuple[State, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        """Whether a path can be spelled at all: a move command and an integer among the tokens."""
        flat = {item for items in self.items.values() for item in items}
        return bool(flat & {"M", "m"}) and any(item.isdigit() for item in flat)

    def at(self, state: State) -> tuple[tuple[int, ...], dict[int, State]]:
        """(the allowed ids at `state`, eos included where the path may end; each path id's next state)."""
        found = self._states.get(state)
        if found is None:
            nexts = {i: s for i, items in self.items.items() if (s := advance(state, items)) is not None}
            allowed = tuple(sorted(nexts)) + ((self.eos_id,) if complete(state) else ())
            found = (allowed, nexts)
            with self._lock:
                self._states[state] = found
        return found

    def mask_row(self, state: State, words: int) -> torch.Tensor:
        """The bitmask row (int32 words) allowing exactly `at(state)`'s ids (cached per state)."""
        row = self._rows.get((state, words))
        if row is None:
            row = torch.zeros(1, words, dtype=torch.int32)
            _only_bits(row, 0, self.at(state)[0])
            with self._lock:
                self._rows[(state, words)] = row
        return row[0]


class SegmentMatcher:
    """One segment answer: coord, coord, size (region steps), then path tokens until eos."""

    fills_own_mask = True
    REGION_KINDS = (COORD, COORD, SIZE)

    def __init__(self, tokens: PathTokens) -> None:
        self.tokens = tokens
        self.history: list[int] = []
        # the reader's (`value`): the path written so far over items[:written], and the box once known;
        # a stream reads after every chunk, so each read writes only the items settled since the last
        self._written, self._writer = 0, PathWriter()
        self._bbox: dict[str, float] | None = None
        self._replay()

    def _replay(self) -> None:
        self.regions: list[tuple[str, tuple[int, ...]]] = []
        self.items: list[str] = []  # the committed path items, in order
        self.settled = 0  # items[:settled] are complete command groups
        self.state: State = START
        self.done = False
        for value in self.history:
            self._advance(value)

    def step_kind(self) -> int:
        return self.REGION_KINDS[len(self.regions)] if len(self.regions) < 3 else TOKEN

    def commit(self, value_id: int) -> None:
        self._advance(value_id)
        self.history.append(value_id)

    def _advance(self, value_id: int) -> None:
        if self.done:
            raise ValueError(f"the segment answer is complete; got {value_id}")
        kind, bins = value_of(self.tokens.vocab_size, value_id)
        if len(self.regions) < 3:
            expected = "size" if len(self.regions) == 2 else "coord"
            if kind != expected:
                raise ValueError(f"segment: expected a {expected} value, got {kind} {value_id}")
            self.regions.append((kind, bins))
            return
        if value_id == self.tokens.eos_id and complete(self.state):
            self.done = True
            return
        _, nexts = self.tokens.at(self.state)
        if value_id not in nexts:
            raise ValueError(f"segment: token {value_id} does not continue the path here")
        self.items.extend(self.tokens.items[value_id])
        self.state = nexts[value_id]
        if complete(self.state):
            self.settled = len(self.items)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if len(self.regions) < 3:
            bitmask[row] = -1  # a region step: the runner reads the heads, the token is not used
            return
        bitmask[row] = self.tokens.mask_row(self.state, bitmask.shape[1])

    def is_terminated(self) -> bool:
        return self.done

    def rollback(self, n: int) -> None:
        if n:
            del self.history[-n:]
            self._replay()

    def value(self, final: bool) -> dict[str, Any]:
        """{"bbox": the box (None before the size step), "path": the complete groups' path, normalized};
        `final`: the path must be one (not empty, parses, inside the image), SvgPathError otherwise."""
        settled, regions = self.settled, list(self.regions)  # read once: the engine thread commits
        writer = self._writer_upto(settled)
        if self._bbox is None and len(regions) == 3:
            (_, (x,)), (_, (y,)), (_, (w, h)) = regions
            width, height = size_from_bins(torch.tensor([w, h])).tolist()
            self._bbox = bbox_from_region(
                coord_from_bin(torch.tensor(x)).item(), coord_from_bin(torch.tensor(y)).item(), width, height
            )
        bbox = self._bbox
        if final:
            if not settled:
                raise SvgPathError(
                    "segment: the answer ended before its path had one complete command "
                    "(settings['max_tokens'] too small, or the model stopped); raise max_tokens"
                )
            return {"path": writer.finish(), "bbox": bbox}
        return {"path": writer.path, "bbox": bbox}

    def _writer_upto(self, settled: int) -> PathWriter:
        """The path writer over items[:settled], extended from the last read's."""
        if settled < self._written:  # rolled back below what was read: write it again
            self._written, self._writer = 0, PathWriter()
        for item in self.items[self._written : settled]:
            self._writer.add(item)
        self._written = settled
        return self._writer


def value_of_ids(tokens: PathTokens, token_ids: list[int]) -> dict[str, Any]:
    """A finished segment answer's value from its committed ids (the engine's output, eos excluded)."""
    matcher = SegmentMatcher(tokens)
    for value_id in token_ids:
        matcher.commit(value_id)
    return matcher.value(final=True)
