"""The two errors of the grammar layer, and how llguidance's refusals become them.

`SchemaError` is raised by `compile()` before any decoding starts: an output spec the layer cannot
enforce exactly (an unsupported JSON-schema keyword, a bad regex, a bad grammar). Its message names
the keyword and its JSON path, or the position in the pattern, and says what to do.
`GrammarViolation` is raised by `Matcher.commit()` for a token the automaton does not allow; the
matcher is left unchanged, so the caller can sample again or stop the request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any


class SchemaError(ValueError):
    """An output spec that cannot be compiled into an exact automaton."""

    def __init__(
        self,
        message: str,
        *,
        keyword: str | None = None,
        path: str | None = None,
        position: str | None = None,
    ) -> None:
        super().__init__(message)
        self.keyword = keyword
        self.path = path
        self.position = position


class GrammarViolation(ValueError):
    """A committed token that the automaton does not allow in its current state."""

    def __init__(self, token_id: int, token_text: str, reason: str = "") -> None:
        why = f" ({reason})" if reason else ""
        super().__init__(
            f"token {token_id} {token_text!r} is not allowed by the grammar here{why}; "
            "sample under the matcher's mask (fill_mask) so only allowed tokens are committed"
        )
        self.token_id = token_id
        self.token_text = token_text


class GrammarLimitError(GrammarViolation):
    """llguidance stopped the automaton mid-output on a resource limit (e.g. LexerTooComplex).

    The output cannot be completed under the grammar; the caller ends the request with this error.
    """

    def __init__(self, token_id: int, token_text: str, detail: str) -> None:
        ValueError.__init__(
            self,
            f"the grammar hit llguidance's resource limit before token {token_id} {token_text!r}: "
            f"{detail[:300]}; simplify the schema (long bounded repetitions in patterns are the usual cause)",
        )
        self.token_id = token_id
        self.token_text = token_text


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_LARK_POSITION = re.compile(r"^at (\d+)\((\d+)\)")
# Property names and enum/const values are data, not keywords: never report a hit under them.
_DATA_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_VALUE_KEYS = frozenset({"enum", "const", "default", "examples", "required"})


def schema_refusal(message: str, schema: Any) -> SchemaError:
    """Turn llguidance's refusal of a JSON schema into a SchemaError naming keyword and path."""
    found = _UNIMPLEMENTED.search(message)
    if not found:
        return _known_refusal(message, schema) or SchemaError(
            f"JSON schema refused: {message.strip()}; simplify the schema at that point"
        )
    keywords = json.loads(found.group(1))
    keyword = keywords[0]
    path = next(_keyword_paths(schema, keyword, "#"), "#")
    return SchemaError(
        f"{keyword!r} is not supported (at {path}): the grammar cannot enforce it exactly, so it "
        f"refuses rather than ignoring it; remove {keyword!r} from the schema and check it after decoding",
        keyword=keyword,
        path=path,
    )


_RANGE = re.compile(r"Failed to generate regex for (integer|float) range: min=(\S+), max=(\S+)")
_MULTIPLE_OF = re.compile(r"Value for 'multipleOf' has too many digits")


def _known_refusal(message: str, schema: Any) -> SchemaError | None:
    """llguidance's refusals of numeric keywords, in our words (keyword, JSON path, what to do)."""
    found = _RANGE.search(message)
    if found:
        kind, low, _ = found.groups()
        names = ("minimum", "exclusiveMinimum") if low != "None" else ("maximum", "exclusiveMaximum")
        keyword, path = next(((k, p) for k in names for p in _keyword_paths(schema, k, "#")), (names[0], "#"))
        return SchemaError(
            f"{keyword!r} (at {path}) is too large for an exact {kind} range: llguidance enforces "
            f"bounds of magnitude up to about 1e18; remove {keyword!r} or use a smaller bound and check the value after decoding",
            keyword=keyword,
            path=path,
        )
    if _MULTIPLE_OF.search(message):
        path = next(_keyword_paths(schema, "multipleOf", "#"), "#")
        return SchemaError(
            f"'multipleOf' (at {path}) has more significant digits than llguidance can enforce exactly; "
            "use a multiple with fewer digits (e.g. 0.01) or remove it",
            keyword="multipleOf",
            path=path,
        )
    return None


def _keyword_paths(node: Any, keyword: str, path: str, under_data: bool = False) -> Iterator[str]:
    if isinstance(node, dict):
        if keyword in node and not under_data:
            yield path
        for key, value in node.items():
            if key in _VALUE_KEYS and not under_data:
                continue
            child = f"{path}/{_pointer_escape(str(key))}"
            yield from _keyword_paths(
                value, keyword, child, under_data=(key in _DATA_KEYS and not under_data)
            )
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _keyword_paths(value, keyword, f"{path}/{i}")


def _pointer_escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def pattern_refusal(kind: str, text: str, message: str) -> SchemaError:
    """A bad regex or Lark grammar: report llguidance's message with the position it found."""
    position = None
    lark_pos = _LARK_POSITION.search(message)
    if kind == "regex":
        position = _regex_caret_position(message)
        where = f" at position {position} (0-based)" if position is not None else ""
    elif lark_pos:
        position = f"line {lark_pos.group(1)}, column {lark_pos.group(2)}"
        where = f" at {position}"
    else:
        where = ""
    return SchemaError(
        f"invalid {kind}{where}: {message.strip()}\nfix the {kind} (llguidance dialect) and compile again",
        position=None if position is None else str(position),
    )


def _regex_caret_position(message: str) -> int | None:
    # The regex crate draws the pattern indented by 4 spaces and a caret under the culprit.
    lines = message.splitlines()
    for i, line in enumerate(lines[1:], start=1):
        stripped = line.strip()
        if stripped and set(stripped) <= {"^"} and lines[i - 1].startswith("    "):
            return line.index("^") - 4
    return None
