"""Output shapes of the point and detect skills, in two encodings, with geometric validity built in.

(a) JSON: `{"points": [{"x": .., "y": ..}]}` and
    `{"objects": [{"x_min": .., "y_min": .., "x_max": .., "y_max": ..}]}`, keys in that order,
    compact whitespace, numbers in [0, 1] with at most 3 decimals (`0`, `0.5`, `0.125`, `1`, `1.0`).
(b) Location tokens (PaliGemma's convention), as `grammars.locations.LocationFormat` defines them
    (bins, item layout, separator: that module is their one owner): a box item is
    `<locYMIN><locXMIN><locYMAX><locXMAX> LABEL`, a point item `<locY><locX> LABEL` (LABEL: the literal
    object phrase given at compile time), items joined by the format's separator (` ; ` by default),
    zero items allowed, then EOS.
Both allow at most `max_objects` items.

Geometric validity (x_min < x_max, y_min < y_max) is enforced inside the automaton; why and how is
in `bounded.py`. The shape itself is a Lark grammar for llguidance. Min fields are restricted to
values that leave room for a larger max (JSON: < 1; loc: bin < N - 1), so the automaton never
reaches a state with no allowed token.

Token budgets. PROBLEM: a caller sizes max_objects to its max_tokens, but llguidance lets a model
spell the same text with any tokens whose bytes make it (`" ; "` as one token or as three, a label
byte by byte), so an answer tokenized canonically can be far shorter than what the model writes
under the mask, and a budget sized from it runs out before the answer is complete.
SOLUTION: `item_token_bounds(spec, tokenizer)` returns the worst case from the spec's `layout()` (the
grammar's fixed text and coordinates, the single source the Lark grammars are built from too): every
token the grammar allows in text covers at least one byte and ends at its own byte, so the tokens
that end inside a piece of fixed text are at most the longest chain of vocabulary tokens that can
end there (any token may reach into the piece from before it), one per byte where the vocabulary
has byte tokens; a text coordinate takes at most one token per byte of its longest spelling, a
location token exactly one, EOS one. Summed over the pieces that partition an answer, this bounds
every tokenization of every answer the grammar allows.
INVARIANTS (tests/grammars/test_token_bounds.py):
1. No walk under the mask, however it spells its answer, takes more tokens than the bound for the
   items it wrote (EOS included).
2. With a vocabulary of byte tokens the bound is reached: the longest answer spelled byte by byte.
3. `layout()` writes answers the grammar accepts.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .automaton import Automaton, lark_automaton
from .bounded import JsonBoxMatcher, JsonBoxTables, LocBoxMatcher, LocBoxTables
from .cache import LRUCache
from .errors import SchemaError
from .locations import COORDINATES, DEFAULT_SEPARATOR, LocationFormat
from .matcher import Matcher
from .tokenizer import TokenizerHandle, tokenizer_handle

NUMBER = r"0(\.[0-9]{1,3})?|1(\.0{1,3})?"
LOW_NUMBER = r"0(\.[0-9]{1,3})?"  # a min coordinate: < 1
HIGH_NUMBER = r"0\.[0-9]{1,3}|1(\.0{1,3})?"  # a max coordinate: > 0 (bounded.py makes it > min)
JSON_COORDINATE = re.compile(rb'": (\d+(?:\.\d+)?)')  # a JSON answer's coordinate (its keys hold no digits)
NUMBER_BYTES = len("0.125")  # the longest spelling any of the three allows (0.ddd, 1.000)
ANSWER_KEYS = {"points": "points", "boxes": "objects"}
# (key, terminal) of each field of a JSON item, in the order the grammar writes them
JSON_FIELDS = {
    "points": (("x", "NUM"), ("y", "NUM")),
    "boxes": (("x_min", "LOW"), ("y_min", "LOW"), ("x_max", "HIGH"), ("y_max", "HIGH")),
}


@dataclass(frozen=True, slots=True)
class SpatialSpec:
    """Points or boxes in one encoding; pass to `grammars.compile(spec, tokenizer)`."""

    kind: str  # "points" | "boxes"
    encoding: str = "json"  # "json" | "loc"
    max_objects: int = 32
    label: str = ""
    bins: int = 1024
    separator: str = DEFAULT_SEPARATOR  # between loc items

    def __post_init__(self) -> None:
        if self.kind not in ("points", "boxes"):
            raise SchemaError(f"spatial kind {self.kind!r} is unknown; use 'points' or 'boxes'")
        if self.encoding not in ("json", "loc"):
            raise SchemaError(f"spatial encoding {self.encoding!r} is unknown; use 'json' or 'loc'")
        if self.max_objects < 1:
            raise SchemaError(f"max_objects={self.max_objects}; it must be at least 1")
        if self.encoding == "json" and self.label:
            raise SchemaError("label is part of the loc encoding only; the JSON shape carries no label")
        try:
            self.locations.check_label(self.label)
        except ValueError as error:
            raise SchemaError(str(error)) from None

    @property
    def locations(self) -> LocationFormat:
        """The location-token format of this spec (bins and separator): how its text is written and read."""
        try:
            return LocationFormat(self.bins, self.separator)
        except ValueError as error:
            raise SchemaError(str(error)) from None

    def example_answer(self, items: int) -> str:
        """An answer of `items` items with the longest coordinates (3 decimals in JSON). Its canonical
        tokenization undercounts what the grammar lets a model write: size token budgets with
        `item_token_bounds`, not with this text."""
        if self.encoding == "loc":
            fmt = self.locations
            item = fmt.box_item((0, 0, 1, 1), self.label) if self.kind == "boxes" else fmt.point_item(0.5, 0.5, self.label)
            return fmt.join([item] * items)
        if self.kind == "points":
            body = ", ".join(['{"x": 0.125, "y": 0.125}'] * items)
            return f'{{"points": [{body}]}}'
        body = ", ".join(['{"x_min": 0.125, "y_min": 0.125, "x_max": 0.875, "y_max": 0.875}'] * items)
        return f'{{"objects": [{body}]}}'

    def layout(self) -> AnswerLayout:
        """What every answer of this spec is made of (the grammar is built from the same pieces)."""
        if self.encoding == "loc":
            tail = self.locations.label_text(self.label)
            item = (LOCATION_TOKEN,) * COORDINATES[self.kind] + ((tail,) if tail else ())
            return AnswerLayout("", "", item, self.separator, "")
        return json_layout(self.kind)

    def coordinate_spans(self, text: bytes) -> list[tuple[int, int]]:
        """The byte spans of the coordinates an answer's text writes as digits, in answer order (what
        scores read: families/scores.py). A loc answer has none (its coordinates are tokens); a spec of
        its own encoding says where its coordinates are by overriding this."""
        if self.encoding == "loc":
            return []
        if self.encoding != "json":
            raise NotImplementedError(f"a spec of encoding {self.encoding!r} declares its own coordinate_spans")
        return [match.span(1) for match in JSON_COORDINATE.finditer(text)]

    def cache_key(self) -> str:
        label, separator = json.dumps(self.label), json.dumps(self.separator)
        return f"spatial:{self.kind}:{self.encoding}:{self.max_objects}:{self.bins}:{label}:{separator}"

    def build(self, handle: TokenizerHandle, key: str) -> Automaton:
        check_spellable(self, handle)
        matcher_class: type[Matcher] | None
        extra: JsonBoxTables | LocBoxTables | None
        if self.encoding == "json":
            lark = json_lark(self.kind, self.max_objects)
            matcher_class, extra = (
                (JsonBoxMatcher, JsonBoxTables(handle)) if self.kind == "boxes" else (None, None)
            )
        else:
            ids = loc_token_ids(handle, self.bins)
            lark = loc_lark(self.kind, self.max_objects, self.label, ids, self.separator)
            matcher_class, extra = (
                (LocBoxMatcher, LocBoxTables(handle, ids)) if self.kind == "boxes" else (None, None)
            )
        kind = f"spatial-{self.kind}-{self.encoding}"
        return lark_automaton(handle, key, kind, lark, matcher_class or Matcher, extra)


def points(*fields: Any, **named: Any) -> SpatialSpec:
    """Spec of the point skill's output: SpatialSpec's fields after `kind` (encoding, max_objects, ...)."""
    return SpatialSpec("points", *fields, **named)


def boxes(*fields: Any, **named: Any) -> SpatialSpec:
    """Spec of the detect skill's output (x_min < x_max and y_min < y_max for every box): SpatialSpec's
    fields after `kind` (encoding, max_objects, label, bins, separator)."""
    return SpatialSpec("boxes", *fields, **named)


def _repeat(item: str, sep: str, max_objects: int) -> str:
    more = f" ({json.dumps(sep)} {item}){{0,{max_objects - 1}}}" if max_objects > 1 else ""
    return f"({item}{more})?"


def json_layout(kind: str) -> AnswerLayout:
    """`{"points": [` items `]}`; an item is `{"x": `, a number, `, "y": `, a number, `}` (boxes: four fields)."""
    item: list[str | Coordinate] = []
    for index, (key, _) in enumerate(JSON_FIELDS[kind]):
        item += [f'{", " if index else "{"}"{key}": ', Coordinate(NUMBER_BYTES)]
    start, end = f'{{"{ANSWER_KEYS[kind]}": [', "]}"
    return AnswerLayout(start + end, start, (*item, "}"), ", ", end)


def json_lark(kind: str, max_objects: int) -> str:
    layout = json_layout(kind)
    terminals = iter(terminal for _, terminal in JSON_FIELDS[kind])
    item = " ".join(next(terminals) if isinstance(p, Coordinate) else json.dumps(p) for p in layout.item)
    rule = "point" if kind == "points" else "box"
    numbers = {"NUM": NUMBER} if kind == "points" else {"LOW": LOW_NUMBER, "HIGH": HIGH_NUMBER}
    return "\n".join(
        [
            f"start: {json.dumps(layout.start)} {_repeat(rule, layout.separator, max_objects)} {json.dumps(layout.end)}",
            f"{rule}: {item}",
            *(f"{name}: /{regex}/" for name, regex in numbers.items()),
        ]
    )


loc_token = LocationFormat.token


def loc_token_ids(handle: TokenizerHandle, bins: int) -> list[int]:
    ids = []
    for token in LocationFormat(bins).tokens():
        token_id = handle.token_to_id(token)
        if token_id is None:
            raise SchemaError(
                f"the tokenizer has no {token} token; add the {bins} location tokens "
                f"{loc_token(0)}..{loc_token(bins - 1)} as special tokens, or use encoding='json'"
            )
        ids.append(token_id)
    return ids


def _token_set(ids: list[int]) -> str:
    """llguidance's token-set syntax `<[a-b,c]>` for a set of token ids."""
    ids = sorted(ids)
    runs = []
    start = prev = ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return "<[" + ",".join(runs) + "]>"


def loc_lark(
    kind: str, max_objects: int, label: str, ids: list[int], separator: str = DEFAULT_SEPARATOR
) -> str:
    text = LocationFormat.label_text(label)
    tail = f" {json.dumps(text)}" if text else ""  # \u escapes: Lark refuses some raw characters (DEL)
    if kind == "points":
        rules = [f"item: loc loc{tail}", f"loc: {_token_set(ids)}"]
    else:
        rules = [
            f"item: low low high high{tail}",
            f"low: {_token_set(ids[:-1])}",
            f"high: {_token_set(ids[1:])}",
        ]
    return "\n".join([f"start: {_repeat('item', separator, max_objects)}", *rules])


# ---- token budgets (module docstring) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Coordinate:
    """A coordinate of an item: one location token (`special`), or text of at most `length` bytes."""

    length: int = 0
    special: bool = False


LOCATION_TOKEN = Coordinate(special=True)


@dataclass(frozen=True, slots=True)
class AnswerLayout:
    """Every answer of a spec: `empty` when it has no item; else `start`, the items joined by `separator`,
    then `end`. An item is its fixed text and coordinates, in order, with at least one coordinate."""

    empty: str
    start: str
    item: tuple[str | Coordinate, ...]
    separator: str
    end: str

    def text(self, items: int, coordinate: Callable[[Coordinate], str]) -> str:
        """An answer of `items` items, each coordinate written by `coordinate`."""
        if not items:
            return self.empty
        one = "".join(p if isinstance(p, str) else coordinate(p) for p in self.item)
        return self.start + self.separator.join([one] * items) + self.end


@dataclass(frozen=True, slots=True)
class ItemTokenBounds:
    """The most tokens a complete answer can take under its grammar, EOS included: `empty` with no item,
    `first` with one item (start and end included), `further` for each further item (its separator
    included). An answer of n >= 1 items takes at most first + (n - 1) * further."""

    empty: int
    first: int
    further: int

    def answer(self, items: int) -> int:
        return self.empty if items == 0 else self.first + (items - 1) * self.further

    def items_within(self, max_tokens: int) -> int:
        """The most items whose every complete answer fits in `max_tokens` (0: not even one)."""
        if max_tokens < self.first:
            return 0
        return 1 + (max_tokens - self.first) // self.further


def item_token_bounds(
    spec: SpatialSpec, tokenizer: Any, *, eos_token_id: int | None = None, vocab_size: int | None = None
) -> ItemTokenBounds:
    """The worst-case tokens of `spec`'s answers for `tokenizer` (any tokenizer `grammars.compile` takes),
    whatever spelling the model picks under the mask (module docstring). max_objects plays no part."""
    handle = tokenizer_handle(tokenizer, eos_token_id=eos_token_id, vocab_size=vocab_size)
    spellings = _spellings(handle)
    layout = spec.layout()
    texts, coordinates = _split(layout.item)
    inner = sum(1 if c.special else c.length for c in coordinates)
    inner += sum(spellings.most_tokens(t) for t in texts[1:-1])
    head, tail = texts[0], texts[-1]
    return ItemTokenBounds(
        empty=spellings.most_tokens(layout.empty) + 1,
        first=spellings.most_tokens(layout.start + head) + inner + spellings.most_tokens(tail + layout.end) + 1,
        further=max(1, spellings.most_tokens(tail + layout.separator + head) + inner),
    )


def check_spellable(spec: SpatialSpec, handle: TokenizerHandle) -> None:
    """Refuse (SchemaError) a spec whose fixed answer text the tokenizer cannot write (see _Spellings.check)."""
    _spellings(handle).check(spec.layout())


def _split(item: tuple[str | Coordinate, ...]) -> tuple[list[str], list[Coordinate]]:
    """The fixed texts around and between the coordinates (one more than coordinates), and the coordinates."""
    texts, coordinates = [""], []
    for piece in item:
        if isinstance(piece, Coordinate):
            coordinates.append(piece)
            texts.append("")
        else:
            texts[-1] += piece
    if not coordinates:
        raise ValueError("an answer item needs at least one coordinate")
    return texts, coordinates


@dataclass(frozen=True, slots=True)
class _Spellings:
    """The vocabulary's text tokens (special tokens never spell text, and no allowed token is empty)."""

    tokens: frozenset[bytes]
    reversed_tokens: list[bytes]  # sorted: which texts some token ends with
    longest: int
    alphabet: frozenset[int]  # the bytes some token holds

    def check(self, layout: AnswerLayout) -> None:
        """SchemaError when the fixed text holds a character no token can write (a vocabulary without
        byte tokens for it): no answer with an item could be written, and the mask would dead-end."""
        for text in (layout.empty, layout.start, layout.separator, layout.end, *_split(layout.item)[0]):
            for char in text:
                missing = [b for b in char.encode() if b not in self.alphabet]
                if missing:
                    raise SchemaError(
                        f"this tokenizer cannot write {char!r} (U+{ord(char):04X}) of the answer text {text!r}: "
                        f"no token holds its byte 0x{missing[0]:02x}; leave that character out of the object phrase"
                    )

    def most_tokens(self, text: str) -> int:
        """The most tokens of any tokenization, in any context, that end inside `text`.

        The first of them covers the text's first byte (it may begin before the text), each next one
        begins where the previous ended: a longest chain over end positions, one per byte at most.
        """
        data = text.encode()
        # best[p]: the most tokens ending inside data[:p] with one ending at p (0: no token can end at p)
        best = [0] * (len(data) + 1)
        for p in range(1, len(data) + 1):
            most = 1 if p <= self.longest and self._some_token_ends_with(data[:p]) else 0
            for j in range(max(1, p - self.longest), p):
                if best[j] and best[j] + 1 > most and data[j:p] in self.tokens:
                    most = best[j] + 1
            best[p] = most
        return max(best)

    def _some_token_ends_with(self, data: bytes) -> bool:
        key = data[::-1]
        index = bisect.bisect_left(self.reversed_tokens, key)
        return index < len(self.reversed_tokens) and self.reversed_tokens[index].startswith(key)


_SPELLINGS: LRUCache[_Spellings] = LRUCache(maxsize=8)


def _spellings(handle: TokenizerHandle) -> _Spellings:
    cached = _SPELLINGS.get(handle.key)
    if cached is None:
        tokens = frozenset(b for b in handle.token_bytes() if b)
        alphabet = frozenset(b for token in tokens for b in token)
        cached = _Spellings(tokens, sorted(t[::-1] for t in tokens), max(map(len, tokens), default=0), alphabet)
        _SPELLINGS.put(handle.key, cached)
    return cached


def parse(spec: SpatialSpec, text: str) -> dict:
    """The skill's result dict from an output text of this spec (loc tokens decoded to floats).

    Raises ValueError (json.JSONDecodeError, locations.LocationParseError) on a text the spec's
    grammar cannot produce: the parse never guesses.
    """
    key = "points" if spec.kind == "points" else "objects"
    if spec.encoding not in ("json", "loc"):  # a family's own format (families/qwen_vl/grounding.py)
        return spec.parse_answer(text)  # type: ignore[attr-defined]  # the family's SpatialSpec subclass has it
    if spec.encoding == "json":
        return json.loads(text)
    return {key: spec.locations.parse(spec.kind, text, spec.label)}
