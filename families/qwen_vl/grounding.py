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

Boxes keep x1 < x2 and y1 < y2 by construction: the Lark grammar enforces the shape (fence, keys, each
field's own range), and the box matcher of `foveal.grammars.integer_boxes` holds x2 (y2) in
(x1, width] ((y1, height]) while it is written.
INVARIANTS (tests/grammars/test_grounding.py):
1. Every answer a random walk under the mask reaches parses, with every box x1 < x2 <= width,
   y1 < y2 <= height, and at most max_objects items; the mask is never empty before termination.
2. commit() of a token that breaks a bound raises GrammarViolation and changes nothing.
3. `int_range(lo, hi)` (grammars/scalars.py) matches exactly the decimal integers in [lo, hi].
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from foveal.grammars.automaton import Automaton, lark_automaton
from foveal.grammars.errors import SchemaError
from foveal.grammars.integer_boxes import IntegerBoxes, IntegerBoxMatcher, integer_box_tables
from foveal.grammars.scalars import int_range
from foveal.grammars.spatial import AnswerLayout, Coordinate, SpatialSpec, check_spellable
from foveal.grammars.tokenizer import TokenizerHandle

FENCE_OPEN, FENCE_CLOSE = "```json\n[", "]\n```"
ITEM_OPEN, ITEM_SEP, ITEMS_CLOSE = "\n\t", ",\n\t", "\n"
KEYS = {"boxes": "bbox_2d", "points": "point_2d"}
COORDINATE_LISTS = re.compile(rb'(?<=_2d": \[)[0-9, ]*(?=\])')  # the numbers of one item's bbox_2d / point_2d
NUMBER = re.compile(rb"\d+")
XML_COORDINATE = re.compile(rb' [xy]\d+="(\d+)"')


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

    def coordinate_spans(self, text: bytes) -> list[tuple[int, int]]:
        """The byte spans of the answer's coordinates, in order (what scores read: families/scores.py)."""
        spans = []
        for listed in COORDINATE_LISTS.finditer(text):
            spans += [(listed.start() + m.start(), listed.start() + m.end()) for m in NUMBER.finditer(listed[0])]
        return spans

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
        assert w is not None and h is not None  # its callers require the scale
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
        assert self.width is not None and self.height is not None  # just checked
        check_spellable(self, handle)
        kind = f"grounding-{self.kind}"
        if self.kind == "points":
            return lark_automaton(handle, key, kind, self.lark())
        opening = self._item_open()[1:].encode()  # '"bbox_2d": [': where a box's list starts
        boxes = IntegerBoxes(integer_box_tables(handle), self.width, self.height, opening)
        return lark_automaton(handle, key, kind, self.lark(), IntegerBoxMatcher, boxes)

    def parse_answer(self, text: str) -> dict:
        """foveal's normalized result of an answer: boxes as x_min..y_max, points as x, y, fractions of the scale."""
        if not self.bound:
            raise SchemaError("cannot parse a grounding answer without its coordinate scale (width/height)")
        body = text.strip()
        if not (body.startswith("```json") and body.endswith("```")):
            raise ValueError(f"not a fenced JSON answer: {text[:80]!r}")
        items = json.loads(body[len("```json") : -len("```")])
        w, h = self.width, self.height
        assert w is not None and h is not None  # bound
        if self.kind == "points":
            return {"points": [_point(item["point_2d"], w, h) for item in items]}
        return {"objects": [_box(item["bbox_2d"], w, h) for item in items]}


def _box(coords: list[int], w: int, h: int) -> dict[str, float]:
    x1, y1, x2, y2 = coords
    return {"x_min": x1 / w, "y_min": y1 / h, "x_max": x2 / w, "y_max": y2 / h}


def _point(coords: list[int], w: int, h: int) -> dict[str, float]:
    x, y = coords
    return {"x": x / w, "y": y / h}


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

    def coordinate_spans(self, text: bytes) -> list[tuple[int, int]]:
        return [match.span(1) for match in XML_COORDINATE.finditer(text)]

    def cache_key(self) -> str:
        return f"grounding-xml:{self.max_objects}:{self.width}x{self.height}:{json.dumps(self.label)}"

    def layout(self) -> AnswerLayout:
        self._require_scale("size a token budget")
        x_name, y_name = self._attributes(XML_WIDEST_INDEX)
        item = (x_name, Coordinate(len(str(self.width))), y_name, Coordinate(len(str(self.height))), '"')
        return AnswerLayout(XML_OPEN + self._close(), XML_OPEN, item, "", self._close())

    def lark(self) -> str:
        assert self.width is not None and self.height is not None  # its callers require the scale
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
        return lark_automaton(handle, key, "grounding-xml-points", self.lark())

    def parse_answer(self, text: str) -> dict:
        import xml.etree.ElementTree as ElementTree

        if not self.bound:
            raise SchemaError("cannot parse a grounding answer without its coordinate scale (width/height)")
        body = text.strip()
        if not (body.startswith("```xml") and body.endswith("```")):
            raise ValueError(f"not a fenced XML answer: {text[:80]!r}")
        assert self.width is not None and self.height is not None  # bound
        element = ElementTree.fromstring(body[len("```xml") : -len("```")].strip())
        count = (len(element.attrib) - 1) // 2
        points = [(element.attrib[f"x{i}"], element.attrib[f"y{i}"]) for i in range(1, count + 1)]
        return {"points": [_point([int(x), int(y)], self.width, self.height) for x, y in points]}
