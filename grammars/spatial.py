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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .automaton import Automaton, compile_template
from .bounded import JsonBoxMatcher, JsonBoxTables, LocBoxMatcher, LocBoxTables
from .errors import SchemaError
from .locations import DEFAULT_SEPARATOR, LocationFormat
from .specs import GrammarSource
from .tokenizer import TokenizerHandle

NUMBER = r"0(\.[0-9]{1,3})?|1(\.0{1,3})?"
LOW_NUMBER = r"0(\.[0-9]{1,3})?"  # a min coordinate: < 1
HIGH_NUMBER = r"0\.[0-9]{1,3}|1(\.0{1,3})?"  # a max coordinate: > 0 (bounded.py makes it > min)


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
        """An answer of `items` items in this spec's canonical spelling, with the longest coordinates
        (3 decimals in JSON): what a caller tokenizes to learn how many items a token budget holds."""
        if self.encoding == "loc":
            fmt = self.locations
            item = fmt.box_item((0, 0, 1, 1), self.label) if self.kind == "boxes" else fmt.point_item(0.5, 0.5, self.label)
            return fmt.join([item] * items)
        if self.kind == "points":
            body = ", ".join(['{"x": 0.125, "y": 0.125}'] * items)
            return f'{{"points": [{body}]}}'
        body = ", ".join(['{"x_min": 0.125, "y_min": 0.125, "x_max": 0.875, "y_max": 0.875}'] * items)
        return f'{{"objects": [{body}]}}'

    def cache_key(self) -> str:
        label, separator = json.dumps(self.label), json.dumps(self.separator)
        return f"spatial:{self.kind}:{self.encoding}:{self.max_objects}:{self.bins}:{label}:{separator}"

    def build(self, handle: TokenizerHandle, key: str) -> Automaton:
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
        template = compile_template(handle, _lark_source(lark, key))
        automaton = Automaton(
            key=key,
            kind=f"spatial-{self.kind}-{self.encoding}",
            grammar=lark,
            tokenizer=handle,
            template=template,
            extra=extra,
            **({"matcher_class": matcher_class} if matcher_class else {}),
        )
        return automaton


def points(*fields: Any, **named: Any) -> SpatialSpec:
    """Spec of the point skill's output: SpatialSpec's fields after `kind` (encoding, max_objects, ...)."""
    return SpatialSpec("points", *fields, **named)


def boxes(*fields: Any, **named: Any) -> SpatialSpec:
    """Spec of the detect skill's output (x_min < x_max and y_min < y_max for every box): SpatialSpec's
    fields after `kind` (encoding, max_objects, label, bins, separator)."""
    return SpatialSpec("boxes", *fields, **named)


def _lark_source(lark: str, key: str) -> GrammarSource:
    import llguidance

    return GrammarSource("lark", key, llguidance.LLMatcher.grammar_from_lark(lark))


def _repeat(item: str, sep: str, max_objects: int) -> str:
    more = f" ({json.dumps(sep)} {item}){{0,{max_objects - 1}}}" if max_objects > 1 else ""
    return f"({item}{more})?"


def json_lark(kind: str, max_objects: int) -> str:
    if kind == "points":
        return "\n".join(
            [
                f'start: "{{\\"points\\": [" {_repeat("point", ", ", max_objects)} "]}}"',
                'point: "{\\"x\\": " NUM ", \\"y\\": " NUM "}"',
                f"NUM: /{NUMBER}/",
            ]
        )
    return "\n".join(
        [
            f'start: "{{\\"objects\\": [" {_repeat("box", ", ", max_objects)} "]}}"',
            'box: "{\\"x_min\\": " LOW ", \\"y_min\\": " LOW ", \\"x_max\\": " HIGH ", \\"y_max\\": " HIGH "}"',
            f"LOW: /{LOW_NUMBER}/",
            f"HIGH: /{HIGH_NUMBER}/",
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
    tail = f" {json.dumps(' ' + label, ensure_ascii=False)}" if label else ""
    if kind == "points":
        rules = [f"item: loc loc{tail}", f"loc: {_token_set(ids)}"]
    else:
        rules = [
            f"item: low low high high{tail}",
            f"low: {_token_set(ids[:-1])}",
            f"high: {_token_set(ids[1:])}",
        ]
    return "\n".join([f"start: {_repeat('item', separator, max_objects)}", *rules])


def parse(spec: SpatialSpec, text: str) -> dict:
    """The skill's result dict from an output text of this spec (loc tokens decoded to floats).

    Raises ValueError (json.JSONDecodeError, locations.LocationParseError) on a text the spec's
    grammar cannot produce: the parse never guesses.
    """
    key = "points" if spec.kind == "points" else "objects"
    if spec.encoding not in ("json", "loc"):  # a subclass with its own encoding (grammars/grounding.py)
        return spec.parse_answer(text)
    if spec.encoding == "json":
        return json.loads(text)
    return {key: spec.locations.parse(spec.kind, text, spec.label)}
