"""Native grounding answers with integer coordinates (Qwen-VL's `bbox_2d` / `point_2d` JSON), geometry enforced.

Shape (the layout Qwen2.5-VL and Qwen3-VL answer in), with at most `max_objects` items:

    ```json
    [
    \t{"bbox_2d": [x1, y1, x2, y2], "label": "car"},
    \t{"bbox_2d": [x1, y1, x2, y2], "label": "car"}
    ]
    ```

points as `{"point_2d": [x, y], "label": ...}`, no items as `[]`. Coordinates are decimal integers
(no leading zeros) on a `width` x `height` scale: x in [0, width], y in [0, height]. Qwen2.5-VL's scale
is the resized input image in pixels (the spec is made per image), Qwen3-VL's is 1000 x 1000. A box
has x1 < x2 and y1 < y2, so x1 <= width - 1 and y1 <= height - 1 (room for a larger max: the mask is
never empty). The label is the literal object phrase. `parse_answer` maps the text to foveal's
normalized result, `{"objects": [{"x_min": x1 / width, ...}]}` / `{"points": [{"x": x / width, ...}]}`:
the resize maps the whole original image onto the whole input, so fractions of the input are
fractions of the original. `layout()` states the answer's pieces (what token budgets are sized from:
grammars/spatial.py `item_token_bounds`); the Lark grammar is built from the same pieces.

PROBLEM: x2 > x1 and y2 > y1 relate two numbers that a context-free grammar cannot compare compactly
(bounded.py explains it for 3-decimal JSON numbers).
SOLUTION: llguidance enforces the shape (a Lark grammar: fence, keys, each field's own range); a
composite matcher (`GroundingBoxMatcher`) refines the mask while x2 or y2 is written, from the
committed text: with the digits so far p and the bound (lo, hi] = (x1, width], a token whose bytes
are digits d followed by nothing may come if some integer in the range starts with p + d; digits d
followed by other bytes only if int(p + d) is in the range. Tokens are grouped by their leading
digits once per automaton, so a mask costs one pass over the groups (Qwen's tokenizer has one digit
per token: 11 groups), cached per (p, lo, hi). Inside a box array, a token that holds digits after
other bytes (`, 4`) would start the next number unchecked; such tokens are refused there.
INVARIANTS (tests/grammars/test_grounding.py):
1. Every answer a random walk under the mask reaches parses, with every box x1 < x2 <= width,
   y1 < y2 <= height, and at most max_objects items; the mask is never empty before termination.
2. commit() of a token that breaks a bound raises GrammarViolation and changes nothing.
3. `int_range(lo, hi)` (grammars/scalars.py) matches exactly the decimal integers in [lo, hi].
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np

from .automaton import Automaton, compile_template
from .bitmask import row_view
from .cache import LRUCache
from .errors import GrammarViolation, SchemaError
from .matcher import Matcher
from .scalars import int_range
from .spatial import AnswerLayout, Coordinate, SpatialSpec, check_spellable
from .specs import GrammarSource
from .tokenizer import TokenizerHandle

FENCE_OPEN, FENCE_CLOSE = "```json\n[", "]\n```"
ITEM_OPEN, ITEM_SEP, ITEMS_CLOSE = "\n\t", ",\n\t", "\n"
KEYS = {"boxes": "bbox_2d", "points": "point_2d"}
_DIGITS = frozenset(b"0123456789")


@dataclass(frozen=True, slots=True)
class GroundingSpec(SpatialSpec):
    """Qwen-VL grounding answers on a width x height integer scale; pass to `grammars.compile`.

    `width` / `height` None: not yet bound to an image (Qwen2.5-VL's scale is the resized input);
    such a spec cannot be compiled.
    """

    encoding: str = "grounding"
    width: int | None = None
    height: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KEYS:
            raise SchemaError(f"grounding kind {self.kind!r} is unknown; use 'points' or 'boxes'")
        if self.encoding != "grounding":
            raise SchemaError("a GroundingSpec's encoding is 'grounding'")
        if self.max_objects < 1:
            raise SchemaError(f"max_objects={self.max_objects}; it must be at least 1")
        for name in ("width", "height"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise SchemaError(f"{name}={value!r}; the coordinate scale must be a positive integer")
            # a 1-unit box scale leaves each coordinate one value: llguidance then forces the whole
            # separator-and-digit run and allows only a token holding digits after a separator,
            # which the x2 > x1 refinement must refuse inside a box (a dead end, not an answer)
            if value == 1 and self.kind == "boxes":
                raise SchemaError(f"{name}=1; a box scale must be at least 2 (x1 < x2 needs two values)")

    @property
    def bound(self) -> bool:
        return self.width is not None and self.height is not None

    def item(self, coords: list[int]) -> str:
        return f'{{"{KEYS[self.kind]}": [{", ".join(map(str, coords))}], "label": {json.dumps(self.label)}}}'

    def example_answer(self, items: int) -> str:
        """An answer of `items` items with the longest coordinates (token budgets: `item_token_bounds`)."""
        w, h = self.width or 1000, self.height or 1000
        coords = [w - 1, h - 1, w, h] if self.kind == "boxes" else [w, h]
        body = ITEM_SEP.join([self.item(coords)] * items)
        return FENCE_OPEN + (ITEM_OPEN + body + ITEMS_CLOSE if items else "") + FENCE_CLOSE

    def cache_key(self) -> str:
        return f"grounding:{self.kind}:{self.max_objects}:{self.width}x{self.height}:{json.dumps(self.label)}"

    def layout(self) -> AnswerLayout:
        """What every answer of this spec is made of (its grammar is built from the same pieces)."""
        self._require_scale("size a token budget")
        item: list[str | Coordinate] = [self._item_open()]
        for index, (_, _, hi) in enumerate(self._fields()):
            item += [", "] if index else []
            item.append(Coordinate(len(str(hi))))
        item.append(self._item_close())
        return AnswerLayout(
            FENCE_OPEN + FENCE_CLOSE, FENCE_OPEN + ITEM_OPEN, tuple(item), ITEM_SEP, ITEMS_CLOSE + FENCE_CLOSE
        )

    def _item_open(self) -> str:
        return f'{{"{KEYS[self.kind]}": ['

    def _item_close(self) -> str:
        return f'], "label": {json.dumps(self.label)}}}'

    def _fields(self) -> list[tuple[str, int, int]]:
        """(terminal, lowest, highest) of each coordinate, in order: a box's min leaves room for its max."""
        w, h = self.width, self.height
        if self.kind == "boxes":
            return [("XLO", 0, w - 1), ("YLO", 0, h - 1), ("XHI", 1, w), ("YHI", 1, h)]
        return [("X", 0, w), ("Y", 0, h)]

    def _require_scale(self, what: str) -> None:
        if not self.bound:
            raise SchemaError(
                f"this grounding spec has no coordinate scale yet (width/height None), so it cannot {what}: "
                "bind it to the image first"
            )

    def lark(self) -> str:
        fields = self._fields()
        values = ' ", " '.join(name for name, _, _ in fields)
        more = f" ({json.dumps(ITEM_SEP)} item){{0,{self.max_objects - 1}}}" if self.max_objects > 1 else ""
        return "\n".join(
            [
                f"start: {json.dumps(FENCE_OPEN)} items? {json.dumps(FENCE_CLOSE)}",
                f"items: {json.dumps(ITEM_OPEN)} item{more} {json.dumps(ITEMS_CLOSE)}",
                f"item: {json.dumps(self._item_open())} {values} {json.dumps(self._item_close())}",
                *(f"{name}: /{int_range(lo, hi)}/" for name, lo, hi in fields),
            ]
        )

    def build(self, handle: TokenizerHandle, key: str) -> Automaton:
        self._require_scale("compile")
        check_spellable(self, handle)
        lark = self.lark()
        source = GrammarSource("lark", key, llguidance.LLMatcher.grammar_from_lark(lark))
        extra = (tables_for(handle), self.width, self.height) if self.kind == "boxes" else None
        return Automaton(
            key=key,
            kind=f"grounding-{self.kind}",
            grammar=lark,
            tokenizer=handle,
            template=compile_template(handle, source),
            extra=extra,
            **({"matcher_class": GroundingBoxMatcher} if self.kind == "boxes" else {}),
        )

    def parse_answer(self, text: str) -> dict:
        """foveal's normalized result of an answer: boxes as x_min..y_max, points as x, y, fractions of the scale."""
        if not self.bound:
            raise SchemaError("cannot parse a grounding answer without its coordinate scale (width/height)")
        body = text.strip()
        if not (body.startswith("```json") and body.endswith("```")):
            raise ValueError(f"not a fenced JSON answer: {text[:80]!r}")
        items = json.loads(body[len("```json") : -len("```")])
        w, h = self.width, self.height
        if self.kind == "points":
            return {"points": [_point(item["point_2d"], w, h) for item in items]}
        return {"objects": [_box(item["bbox_2d"], w, h) for item in items]}


def _box(coords: list[int], w: int, h: int) -> dict[str, float]:
    x1, y1, x2, y2 = coords
    return {"x_min": x1 / w, "y_min": y1 / h, "x_max": x2 / w, "y_max": y2 / h}


def _point(coords: list[int], w: int, h: int) -> dict[str, float]:
    x, y = coords
    return {"x": x / w, "y": y / h}


# ---- the x2 > x1, y2 > y1 refinement ----------------------------------------------------------------------------


def _viable(prefix: str, lo: int, hi: int) -> bool:
    """Some integer in [lo, hi], written without leading zeros, starts with `prefix` (digits)."""
    if not prefix:
        return lo <= hi
    if prefix[0] == "0" and prefix != "0":
        return False
    if prefix == "0":
        return lo <= 0
    head = int(prefix)
    for extra in range(len(str(hi)) - len(prefix) + 1):
        first, last = head * 10**extra, (head + 1) * 10**extra - 1
        if first <= hi and last >= lo:
            return True
    return False


@dataclass(slots=True)
class GroundingTables:
    """Per automaton: tokens grouped by their leading digits, and the cached refinement masks."""

    handle: TokenizerHandle
    token_bytes: list[bytes] = field(init=False)
    # (leading digits, more bytes after them) -> token ids
    groups: dict[tuple[str, bool], np.ndarray] = field(init=False)
    free: np.ndarray = field(init=False)  # every token but the straddling ones
    _masks: dict[tuple[str, int, int], np.ndarray] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.token_bytes = self.handle.token_bytes()
        groups: dict[tuple[str, bool], list[int]] = {}
        for token_id, data in enumerate(self.token_bytes):
            digits = len(data) - len(data.lstrip(b"0123456789"))
            rest = data[digits:]
            if any(b in _DIGITS for b in rest):
                continue  # digits after other bytes: refused inside a box (see the module docstring)
            groups.setdefault((data[:digits].decode(), bool(rest)), []).append(token_id)
        self.groups = {k: np.asarray(v, dtype=np.int64) for k, v in groups.items()}
        bits = np.zeros(self.handle.mask_words * 32, dtype=bool)
        for ids in self.groups.values():
            bits[ids] = True
        self.free = np.packbits(bits, bitorder="little").view(np.int32)

    def mask(self, partial: str, lo: int, hi: int) -> np.ndarray:
        """Allowed tokens while a number in [lo, hi] is written and `partial` holds its digits so far."""
        key = (partial, lo, hi)
        cached = self._masks.get(key)
        if cached is None:
            bits = np.zeros(self.handle.mask_words * 32, dtype=bool)
            for (digits, more), ids in self.groups.items():
                number = partial + digits
                if more:
                    ok = bool(number) and lo <= int(number) <= hi and _viable(number, lo, hi)
                else:
                    ok = _viable(number, lo, hi)
                if ok:
                    bits[ids] = True
            cached = np.packbits(bits, bitorder="little").view(np.int32)
            if len(self._masks) > 4096:
                self._masks.clear()
            self._masks[key] = cached
        return cached

    def allows(self, mask: np.ndarray, token_id: int) -> bool:
        return bool((int(mask[token_id >> 5]) >> (token_id & 31)) & 1)


# One GroundingTables per tokenizer: Qwen2.5-VL compiles one automaton per resized image size, and
# grouping a 150k-token vocabulary takes longer than compiling the grammar.
_TABLES: LRUCache[GroundingTables] = LRUCache(maxsize=16)


def tables_for(handle: TokenizerHandle) -> GroundingTables:
    tables = _TABLES.get(handle.key)
    if tables is None:
        tables = GroundingTables(handle)
        _TABLES.put(handle.key, tables)
    return tables


_OPEN = b'"bbox_2d": ['
_UNBOUNDED = 10**12  # x1, y1: their ranges are llguidance's; here only straddling tokens are refused


class GroundingBoxMatcher(Matcher):
    """Boxes as [x1, y1, x2, y2]: while x2 (y2) is written, its value is held in (x1, width] ((y1, height])."""

    __slots__ = ("_tables", "_w", "_h", "_text", "_lengths")
    refines = True

    def __init__(self, automaton: Automaton, ll: llguidance.LLMatcher) -> None:
        super().__init__(automaton, ll)
        self._tables, self._w, self._h = automaton.extra
        self._text = bytearray()
        self._lengths: list[int] = []  # bytes each committed token added

    def _constraint(self) -> np.ndarray | None:
        """The refinement mask inside a box array (None outside one)."""
        text = self._text
        start = text.rfind(_OPEN)
        if start < 0:
            return None
        body = bytes(text[start + len(_OPEN) :])
        if b"]" in body:
            return None
        fields = body.split(b", ")
        partial = fields[-1]
        if partial and not partial.isdigit():  # a separator is being written: no number in progress
            return self._tables.free
        digits = partial.decode()
        if len(fields) == 3:
            return self._tables.mask(digits, int(fields[0]) + 1, self._w)
        if len(fields) == 4:
            return self._tables.mask(digits, int(fields[1]) + 1, self._h)
        return self._tables.mask(digits, 0, _UNBOUNDED)

    def commit(self, token_id: int) -> None:
        mask = self._constraint()
        if mask is not None and not self._tables.allows(mask, token_id):
            raise GrammarViolation(
                token_id, self.automaton.tokenizer.token_text(token_id), "a box's max must exceed its min"
            )
        super().commit(token_id)
        data = self._tables.token_bytes[token_id] if token_id < len(self._tables.token_bytes) else b""
        self._text += data
        self._lengths.append(len(data))

    def forced_tokens(self) -> list[int]:
        """llguidance's forced tokens (jump-forward), cut before the first that holds a digit: llguidance
        does not know the x2 / y2 bounds (in practice no coordinate is forced: every range has several
        values; a digit in the label only loses its jump)."""
        forced = super().forced_tokens()
        texts = self._tables.token_bytes
        for index, token in enumerate(forced):
            if token >= len(texts) or _DIGITS.intersection(texts[token]):
                return forced[:index]
        return forced

    def _refine(self, ptr: int, row: int, words: int) -> None:
        mask = self._constraint()
        if mask is not None:
            row_view(ptr, row, words)[:] &= mask

    def rollback(self, n: int) -> None:
        super().rollback(n)
        for _ in range(n):
            cut = self._lengths.pop()
            if cut:
                del self._text[-cut:]


def grounding(kind: str, **fields: Any) -> GroundingSpec:
    """A GroundingSpec of `kind` ("boxes" or "points"): max_objects, label, width, height."""
    return GroundingSpec(kind, **fields)


# ---- Qwen2.5-VL's XML points ------------------------------------------------------------------------------------

XML_OPEN, XML_CLOSE = "```xml\n<points", "</points>\n```"
XML_WIDEST_INDEX = 1000  # token budgets take every item as wide as the widest attribute name (x1000)
_XML_UNSAFE = '"<>&'


@dataclass(frozen=True, slots=True)
class XmlPointsSpec(GroundingSpec):
    """Qwen2.5-VL's point answer, as its cookbook documents it: one element with numbered attributes,

        ```xml
        <points x1="X" y1="Y" x2="X" y2="Y" alt="LABEL">LABEL</points>
        ```

    (no attribute pairs when nothing matches), integers on the width x height scale. `parse_answer`
    maps it to `{"points": [{"x": X / width, "y": Y / height}, ...]}`. The attribute names differ by
    item (x1, x2, ...), so `layout()`, which token budgets are sized from, writes each item with the
    widest name (x1000): an upper bound of what any item takes, not a text the grammar accepts.
    """

    def __post_init__(self) -> None:
        GroundingSpec.__post_init__(self)
        if self.kind != "points":
            raise SchemaError("an XmlPointsSpec answers points; use GroundingSpec('boxes', ...) for boxes")
        if any(c in self.label for c in _XML_UNSAFE):
            raise SchemaError(
                f"object phrase {self.label!r} holds one of {_XML_UNSAFE}, which the XML answer cannot carry "
                "unescaped; describe the object without them"
            )

    def _attributes(self, index: int) -> tuple[str, str]:
        return f' x{index}="', f'" y{index}="'

    def _close(self) -> str:
        return f' alt="{self.label}">{self.label}{XML_CLOSE}'

    def example_answer(self, items: int) -> str:
        w, h = self.width or 1000, self.height or 1000
        pairs = "".join(
            f'{self._attributes(i)[0]}{w}{self._attributes(i)[1]}{h}"' for i in range(1, items + 1)
        )
        return XML_OPEN + pairs + self._close()

    def cache_key(self) -> str:
        return f"grounding-xml:{self.max_objects}:{self.width}x{self.height}:{json.dumps(self.label)}"

    def layout(self) -> AnswerLayout:
        self._require_scale("size a token budget")
        x_name, y_name = self._attributes(XML_WIDEST_INDEX)
        item = (x_name, Coordinate(len(str(self.width))), y_name, Coordinate(len(str(self.height))), '"')
        return AnswerLayout(XML_OPEN + self._close(), XML_OPEN, item, "", self._close())

    def lark(self) -> str:
        rules = [f"start: {json.dumps(XML_OPEN)} pts1? {json.dumps(self._close())}"]
        for i in range(1, self.max_objects + 1):
            x_name, y_name = self._attributes(i)
            more = f" pts{i + 1}?" if i < self.max_objects else ""
            rules.append(f'pts{i}: {json.dumps(x_name)} X {json.dumps(y_name)} Y "\\""{more}')
        rules += [f"X: /{int_range(0, self.width)}/", f"Y: /{int_range(0, self.height)}/"]
        return "\n".join(rules)

    def build(self, handle: TokenizerHandle, key: str) -> Automaton:
        self._require_scale("compile")
        check_spellable(self, handle)
        lark = self.lark()
        source = GrammarSource("lark", key, llguidance.LLMatcher.grammar_from_lark(lark))
        return Automaton(
            key=key,
            kind="grounding-xml-points",
            grammar=lark,
            tokenizer=handle,
            template=compile_template(handle, source),
        )

    def parse_answer(self, text: str) -> dict:
        import xml.etree.ElementTree as ElementTree

        if not self.bound:
            raise SchemaError("cannot parse a grounding answer without its coordinate scale (width/height)")
        body = text.strip()
        if not (body.startswith("```xml") and body.endswith("```")):
            raise ValueError(f"not a fenced XML answer: {text[:80]!r}")
        element = ElementTree.fromstring(body[len("```xml") : -len("```")].strip())
        count = (len(element.attrib) - 1) // 2
        points = [(element.attrib[f"x{i}"], element.attrib[f"y{i}"]) for i in range(1, count + 1)]
        return {"points": [_point([int(x), int(y)], self.width, self.height) for x, y in points]}
