"""The two errors of the grammar layer, and how llguidance's refusals become them.

`SchemaError` is raised by `compile()` before any decoding starts: an output spec the layer cannot
enforce exactly (an unsupported JSON-schema keyword, a bad regex, a bad grammar). Its message names
the keyword and its JSON path, or the position in the pattern, and says what to do.
`GrammarViolation` is raised by `Matcher.commit()` for a token the automaton does not allow; the
matcher is left unchanged, so the caller can sample again or stop the request.

Native text: llguidance reports an internal failure (a Rust panic) as an error string that holds the
panic's location and a backtrace, with the build's file paths (`/rustc/...`, `~/.cargo/registry/...`).
Such text reaches HTTP clients through SchemaError (the server answers 422 with its message), so
`clean_native` reduces a panic to its first meaningful line, without paths, and shortens llguidance's
grammar excerpts (a one-line grammar is quoted whole). INVARIANT: no SchemaError or GrammarLimitError
message holds a backtrace or a build path: their constructors clean what they are given.
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
        limit: str | None = None,
    ) -> None:
        super().__init__(clean_native(message))
        self.keyword = keyword
        self.path = path
        self.position = position
        self.limit = limit  # the CompileBudget field a refusal on cost names (grammars/limits.py)


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
            f"{clean_native(detail)[:300]}; simplify the schema (long bounded repetitions in patterns are "
            "the usual cause)",
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
            f"JSON schema refused: {shorten_lines(message.strip())}; simplify the schema at that point"
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


# What a refusal on cost says: the budget field, what it counts, and how to need less of it.
_LLGUIDANCE_LIMITS = (
    (
        re.compile(r"grammar size \(number of symbols\) too big \(limit for this grammar: (\d+)\)"),
        "max_symbols",
        "grammar symbols",
        "simplify it (fewer rules, alternatives, properties or enum values)",
    ),
    (
        re.compile(r"initial lexer configuration \(grammar\) too big \(limit for this grammar: (\d+)\)"),
        "max_lexer_fuel",
        "units of lexer fuel (work building its regexes)",
        "simplify its patterns (fewer alternatives, smaller counted repetitions)",
    ),
)


def budget_refusal(message: str, what: str) -> SchemaError | None:
    """llguidance's refusal on one of the compile budget's limits (grammars/limits.py), in our words."""
    for pattern, field, unit, advice in _LLGUIDANCE_LIMITS:
        found = pattern.search(message)
        if found:
            return over_budget(what, f"needs more than {int(found.group(1)):,} {unit}", field, advice)
    return None


def over_budget(what: str, why: str, field: str, advice: str) -> SchemaError:
    """A spec refused because compiling it would cost more than the compile budget allows."""
    return SchemaError(
        f"the {what} is too large to compile: it {why}, over the compile budget's {field}; "
        f"{advice}, or raise the limit for every compile with "
        f"grammars.set_compile_budget(grammars.CompileBudget({field}=...)) or for one with "
        f"grammars.compile(..., budget=grammars.CompileBudget({field}=...))",
        limit=field,
    )


def native_failure(message: str, what: str) -> SchemaError | None:
    """A panic inside llguidance's compiler, as a SchemaError that says what to do (None: no panic)."""
    if not _NATIVE.search(message):
        return None
    line = panic_line(message)
    if "symbols.len()" in line and "u16::MAX" in line:
        line = "more than 65,000 grammar symbols, llguidance's hard limit"
    return SchemaError(
        f"llguidance failed inside its compiler on this {what} ({line}); this happens to {what}s too "
        f"large or too deeply nested for it: simplify it (fewer rules, alternatives, literals or "
        "properties) and compile again"
    )


# Markers of native (Rust) failure text: a panic, its backtrace, or a build path.
_NATIVE = re.compile(
    r"panicked at|(?:^|\s)panic: |<backtrace>|stack backtrace:|RUST_BACKTRACE|/rustc/|\.cargo[/\\]registry",
    re.M,
)
_PANIC_START = re.compile(r"thread '[^']*' panicked at (?:'(?P<message>[^']*)',?)?|(?:^|(?<=\s))panic: ")
_TRACE = re.compile(
    r"^(?:<backtrace>|</backtrace>|stack backtrace:|\d+: .*|at \S.*|note: .*RUST_BACKTRACE.*)$"
)
_BUILD_PATH = re.compile(
    r"/rustc/\S*|\S*\.cargo[/\\]registry\S*"
    r"|(?:[A-Za-z]:)?(?:[\w.~@+-]*[/\\])+[\w.~@+-]+\.(?:rs|c|h|cc|cpp|py)(?::\d+)*"
)
_MAX_LINE = 300


def clean_native(text: str) -> str:
    """`text` with a Rust panic (message, location, backtrace) reduced to the panic's first meaningful
    line and build paths removed; text with no trace of native failure is returned unchanged."""
    if not _NATIVE.search(text):
        return text
    lines = re.sub(r"</backtrace>(?!\n)", "</backtrace>\n", text).splitlines()
    start = next(i for i, line in enumerate(lines) if _NATIVE.search(line))
    panic = _PANIC_START.search(lines[start])
    if panic is None:  # a build path without a panic: remove the paths only
        return "\n".join(_BUILD_PATH.sub("", line) for line in lines)
    block = [lines[start][panic.start() :], *lines[start + 1 :]]
    traces = [i for i, line in enumerate(block) if _TRACE.match(line.strip())]
    end = traces[-1] if traces else 0
    if end == 0 and not panic_line(block[0], fallback="") and len(block) > 1:
        end = 1  # "thread 'x' panicked at src/f.rs:1:2:" with the message on the next line
    first, rest = lines[start][: panic.start()] + panic_line("\n".join(block[: end + 1])), block[end + 1 :]
    if rest and rest[0][:1] in (";", ",", "."):  # our own text went on after llguidance's "</backtrace>"
        first, rest = first + rest[0], rest[1:]
    kept = [*lines[:start], first, *rest]
    return "\n".join(_BUILD_PATH.sub("", line) for line in kept)


def panic_line(text: str, fallback: str = "an internal error") -> str:
    """The first meaningful line of a Rust panic's text: its message, without location or paths."""
    for line in text.splitlines():
        found = _PANIC_START.search(line)
        if found and found.group("message"):
            return found.group("message")
        if found:
            line = line[found.end() :]
        line = _BUILD_PATH.sub("", line).strip(" :\t")
        if line and not _TRACE.match(line):
            return line[:_MAX_LINE]
    return fallback


def shorten_lines(text: str) -> str:
    """llguidance quotes the grammar line it complains about, whole: a one-line grammar of 200 KB
    would make a 200 KB message. Each line is cut to _MAX_LINE characters."""
    return "\n".join(
        line if len(line) <= _MAX_LINE else line[:_MAX_LINE] + " ..." for line in text.splitlines()
    )


def pattern_refusal(kind: str, text: str, message: str) -> SchemaError:
    """A bad regex or Lark grammar: report llguidance's message with the position it found."""
    position: int | str | None = None
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
        f"invalid {kind}{where}: {shorten_lines(message.strip())}\n"
        f"fix the {kind} (llguidance dialect) and compile again",
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
