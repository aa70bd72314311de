"""String constraints of a JSON schema made exact, and its numbers bounded, before llguidance compiles it.

PROBLEM: llguidance enforces some string keywords more loosely than the JSON-Schema spec, so an
automaton could emit a string the schema forbids (a false accept):
- `format: date` / `date-time` accept 29 February of every year; `time` / `date-time` accept the
  leap second `:60` at any minute, where RFC 3339 allows it only when the UTC time is 23:59;
  `format: hostname` accepts names over 253 characters and any `xn--` (or other `??--`) label,
  though most such labels are not valid IDNA A-labels.
- `pattern` is read with Rust's classes: `\\s` is Unicode White_Space (has U+0085, lacks U+FEFF),
  and `.` matches `\\r`, U+2028, U+2029, where ECMA-262 (the dialect of JSON-schema patterns)
  differs on each.
- draft-07's `contentEncoding` / `contentMediaType` are asserted by the test suite, but llguidance
  treats them as annotations.

SOLUTION: `exact_string_constraints(schema)` returns a rewritten copy (the caller's dict is never
changed), before llguidance sees it. The policy per keyword, in order of preference:
1. Exact: a format whose llguidance regex is looser than the spec is replaced by our own regex
   (written in the common subset of ECMA, Rust and Python regex syntax) as a `pattern`, joined to
   any pattern the node already has through `allOf`:
   - `date`: RFC 3339 full-date with month lengths and Gregorian leap years (years 0001-9999:
     year 0000, which RFC 3339 allows, is rejected as python-jsonschema and `datetime` do).
   - `time`: RFC 3339 full-time; `:60` only at a local time that is 23:59 UTC once the offset is
     applied, enumerated for Z and every offset whose minutes are 00, 30 or 45 (all UTC offsets
     in use). `date-time`: date + `[Tt]` + time.
   - `contentEncoding: base64` (draft-07 only): RFC 4648 base64 with padding.
   - `pattern` (and `patternProperties` keys): `\\s`, `\\S` and `.` become the explicit ECMA-262
     character classes (WhiteSpace + LineTerminator; `.` excludes the four line terminators).
2. Narrower, documented (a false reject, never a false accept): a leap second written with an
   offset whose minutes are not 00/30/45 (e.g. `00:00:60+00:01`) is rejected: all 2 x 1,440
   offsets would take a 60 KB regex, slow to compile. `hostname` is RFC 1123 LDH labels
   of at most 63 characters, at most 253 in all, no trailing dot, and no label with `--` in its
   3rd and 4th positions. Valid IDNA A-labels (`xn--...`) are therefore not emitted: whether one
   is valid depends on Punycode decoding and IDNA2008 rules, which no regular language captures.
3. Refused with `SchemaError` naming keyword and JSON path: `idn-hostname`, `idn-email`, `iri`,
   `iri-reference` (IDNA / Unicode rules, not regular); in draft-07, `contentMediaType` (any value:
   whether text is e.g. JSON is not regular) and any `contentEncoding` other than base64.
Other formats are left to llguidance (`email`, `ipv4`, `ipv6`, `uuid`, `uri`, `duration`: no false
accept on the JSON-Schema-Test-Suite; names it does not know it refuses). In 2020-12 and in
schemas that name no draft, `contentEncoding` / `contentMediaType` are annotations, as the spec says.

NUMBERS. PROBLEM: an integer or number with no bound (a pydantic `int` field, `{"type": "integer"}`)
lets a model write digits until the context is full (a 400-digit integer was seen).
SOLUTION: `bounded_numbers(schema)` returns a copy in which every `integer` / `number` node (not an
`enum` / `const`) gets the bound it lacks on each side; the bounds a node has are kept as they are:
- `integer`: [-(2**63 - 1024), 2**63 - 1], the int64 range except its lowest 1024 values. llguidance
  reads bounds as doubles and casts them to i64: `maximum: 2**63 - 1` becomes the double 2**63, which
  the saturating cast makes exactly 2**63 - 1; but below -(2**63 - 1024) the only double is -2**63,
  and any integer range, `const` or `enum` reaching it fails to compile or crashes the process, so
  -(2**63 - 1024) is the lowest bound it builds exactly (refusing -2**63..-2**63 + 1023: narrower,
  never wider).
- `number`: |x| < 10**15 (`exclusiveMinimum` / `exclusiveMaximum`), at most 15 integer digits: every
  integer part is then exact in a double (< 2**53), and a value of at most 15 significant digits
  survives text -> double -> text (DBL_DIG); and `multipleOf: 1e-10`, at most 10 fraction digits
  (trailing zeros included): llguidance builds multipleOf from a double's decimal digits, and 1e-10 is
  the smallest power of ten it reads exactly (1e-11 is refused as "too many digits"). A bounded
  number has no exponent in llguidance (1e5 is written 100000), so magnitudes below 1e-10 are 0.
  The multipleOf is left out of a schema that has one anywhere: llguidance intersects two (allOf,
  `$ref` siblings) through a common denominator that overflows for 1e-10 and accepts nothing.
- A node whose own bound lies outside these ranges (e.g. `minimum: 1e20`) gets no bound on the other
  side (it would be unsatisfiable); mixed types (`["integer", "null"]`) are bounded for their numbers,
  and `number` with `integer` counts as `number`. Nodes without a numeric type (`{}`) are not changed.
Valid values parse as before: only texts of values outside the ranges are refused. And what makes
llguidance crash the process is refused with SchemaError: an integer in `const` / `enum` whose nearest
double is -2**63, an integer range whose both bounds read as -2**63 or less.

INVARIANTS (tests/grammars/test_formats.py has a test for each; numbers: tests/grammars/test_numbers.py):
1. The rewrite never widens: every string our regexes accept is valid for the spec's rule.
2. `date`, `time` and `date-time` accept exactly the spec's strings, minus the leap seconds of
   point 2 above (checked for every offset, on 20,000 random time/offset pairs, and over all
   months and days of representative years and every 29 February of 0001-9999).
3. Keywords at data positions (`enum`, `const`, `default`, `examples`, property names) are never
   rewritten, and the input schema is never mutated.
4. A refused keyword raises SchemaError naming the keyword and its JSON path, before compiling.
5. Integers: -(2**63 - 1024) and 2**63 - 1 are accepted, one past either is refused, exactly; numbers:
   15 integer and 10 fraction digits are accepted, one more of either is refused.
6. A bound the schema gives is kept: the grammar accepts exactly what it accepted before, within the ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import SchemaError
from .limits import check_regex, check_schema_node

# --- exact regexes ---------------------------------------------------------------------------

_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999
# Divisible by 4 and not by 100, or divisible by 400 (0000 excluded with every year 0000).
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"

_FRACTION = "(?:[.][0-9]+)?"
_OFFSET = "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"


_TIME_NO_LEAP = f"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]{_FRACTION}{_OFFSET}"
# Minutes of the UTC offsets in use (IANA zones): whole, half and three-quarter hours.
LEAP_OFFSET_MINUTES = (0, 30, 45)


def _leap_seconds() -> str:
    """`HH:MM:60<fraction><offset>` exactly when HH:MM minus the offset is 23:59 UTC.

    Local time = 23:59 + offset, so each offset allows one local HH:MM. Covering every offset would
    take 24 x 60 x 2 alternatives (a regex slow to compile; two intersected regexes exhausted
    llguidance's lexer when a schema added its own pattern), so Z and offsets
    whose minutes are in LEAP_OFFSET_MINUTES are covered, grouped by local hour.
    """
    offsets: dict[tuple[int, int], list[str]] = {(23, 59): ["[Zz]"]}
    for sign in ("[+]", "-"):
        for hours in range(24):
            for minutes in LEAP_OFFSET_MINUTES:
                shift = hours * 60 + minutes
                local = (23 * 60 + 59 + (shift if sign == "[+]" else -shift)) % (24 * 60)
                offsets.setdefault(divmod(local, 60), []).append(f"{sign}{hours:02d}:{minutes:02d}")
    by_hour: dict[int, list[str]] = {}
    for (hour, minute), zones in sorted(offsets.items()):
        by_hour.setdefault(hour, []).append(f"{minute:02d}:60{_FRACTION}(?:{'|'.join(zones)})")
    return "(?:" + "|".join(f"{hour:02d}:(?:{'|'.join(cases)})" for hour, cases in by_hour.items()) + ")"


TIME = f"(?:{_TIME_NO_LEAP}|{_leap_seconds()})"
DATE_TIME = f"{DATE}[Tt]{TIME}"

_ALNUM = "[A-Za-z0-9]"
_LDH = "[A-Za-z0-9-]"
# 1-4 characters (a `--` at positions 3-4 is impossible: the 4th is the last, alphanumeric), or
# 5-63 characters whose 3rd and 4th are not both `-`.
_LABEL = (
    f"(?:{_ALNUM}(?:{_LDH}{{0,2}}{_ALNUM})?|{_ALNUM}{_LDH}(?:{_ALNUM}{_LDH}|-{_ALNUM}){_LDH}{{0,58}}{_ALNUM})"
)
HOSTNAME = f"{_LABEL}(?:[.]{_LABEL})*"
HOSTNAME_MAX_LENGTH = 253

BASE64 = "(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?"

# format -> (regex the whole string must match, maxLength or None)
EXACT_FORMATS: dict[str, tuple[str, int | None]] = {
    "date": (DATE, None),
    "time": (TIME, None),
    "date-time": (DATE_TIME, None),
    "hostname": (HOSTNAME, HOSTNAME_MAX_LENGTH),
}
REFUSED_FORMATS = {
    "idn-hostname": "IDNA2008 validity (Punycode, contextual rules) is not a regular language",
    "idn-email": "its domain is an IDN hostname, whose IDNA2008 validity is not a regular language",
    "iri": "IRIs admit Unicode ranges and rules the grammar does not model exactly",
    "iri-reference": "IRIs admit Unicode ranges and rules the grammar does not model exactly",
}

# --- ECMA-262 classes in patterns ------------------------------------------------------------

# ECMA-262 WhiteSpace and LineTerminator: TAB VT FF SP NBSP ZWNBSP, category Zs, LF CR LS PS.
ECMA_WHITESPACE = "\\t\\n\\v\\f\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"
ECMA_DOT = "[^\\n\\r\\u2028\\u2029]"


def ecma_pattern(pattern: str) -> str:
    """The pattern with `\\s`, `\\S` and `.` spelled as ECMA-262 classes (llguidance reads Rust's).

    Walks the pattern as llguidance's parser does (escapes, nested classes, `]` first in a class
    is literal), so `\\\\s` (an escaped backslash then `s`) and `[.]` are left alone.
    """
    out: list[str] = []
    depth = 0  # nesting of [...] classes
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            escape = pattern[i + 1]
            if escape == "s":
                out.append(ECMA_WHITESPACE if depth else f"[{ECMA_WHITESPACE}]")
            elif escape == "S":
                out.append(f"[^{ECMA_WHITESPACE}]")  # nested class inside a class: a union
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[":
            depth += 1
            out.append(c)
            i += 1
            # A `^` and then a `]` right after the opening bracket are literal members.
            if pattern.startswith("^", i):
                out.append("^")
                i += 1
            if pattern.startswith("]", i):
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(ECMA_DOT if c == "." and not depth else c)
        i += 1
    return "".join(out)


# --- the schema walk -------------------------------------------------------------------------

_DRAFT7 = "draft-07"
# Maps from names to subschemas: the names are data, the values schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Values that are instances or names, never schemas.
_VALUE_KEYS = frozenset({"enum", "const", "default", "examples", "required"})
# Keywords that constrain nothing: a node with only these, `type: string` and a format is shared.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "deprecated"})
SHARED_PREFIX = "foveal-format-"


@dataclass(slots=True)
class _Walk:
    """One rewrite: the draft rule for content keywords, and the formats moved to shared `$defs`.

    llguidance compiles an inline `pattern` once per occurrence but a `$ref` target once per schema, so plain `{"type": "string", "format": F}` nodes become
    `{"$ref": "#/$defs/foveal-format-F"}`. A nested `$id` would change what `#` means, so a
    schema with one is rewritten inline instead.
    """

    draft7: bool
    share: bool
    shared: set[str] = field(default_factory=set)
    nested_id: bool = False


def exact_string_constraints(schema: Any) -> Any:
    """A copy of the schema whose string constraints llguidance enforces exactly (see module doc).

    Raises SchemaError, naming keyword and JSON path, for a keyword that cannot be made exact.
    """
    if not isinstance(schema, dict):
        return schema
    draft7 = _DRAFT7 in str(schema.get("$schema", ""))
    share = isinstance(schema.get("$defs", {}), dict)
    walk = _Walk(draft7, share)
    out = _walk(schema, "#", walk)
    if walk.nested_id and walk.shared:
        walk = _Walk(draft7, share=False)
        out = _walk(schema, "#", walk)
    if walk.shared:
        defs = {SHARED_PREFIX + fmt: _format_schema(fmt) for fmt in sorted(walk.shared)}
        out["$defs"] = {**out.get("$defs", {}), **defs}
    return out


# --- numbers (module docstring) --------------------------------------------------------------

INT64_MAX = 2**63 - 1
INTEGER_RANGE = (-(2**63 - 1024), INT64_MAX)
NUMBER_INTEGER_DIGITS, NUMBER_FRACTION_DIGITS = 15, 10
NUMBER_LIMIT = 10**NUMBER_INTEGER_DIGITS  # exclusive, both signs
NUMBER_STEP = 10.0**-NUMBER_FRACTION_DIGITS  # multipleOf
_NUMERIC_TYPES = frozenset({"integer", "number"})


def bounded_numbers(schema: Any) -> Any:
    """A copy of the schema with every unbounded side of an integer or number bounded (module docstring).

    Raises SchemaError for integers llguidance cannot compile (it would crash the process), see
    `_check_integers`."""
    if not isinstance(schema, dict):
        return schema
    step = None if _has_keyword(schema, "multipleOf") else NUMBER_STEP
    return _map_subschemas(schema, lambda node, path: _bound_numbers(_check_integers(node, path), step))


def _bound_numbers(node: dict, step: float | None) -> dict:
    types = _types(node)
    if not types & _NUMERIC_TYPES or "enum" in node or "const" in node:
        return node
    number = "number" in types
    low, high = (-NUMBER_LIMIT, NUMBER_LIMIT) if number else INTEGER_RANGE
    lower, upper = _bound(node, "minimum", "exclusiveMinimum"), _bound(node, "maximum", "exclusiveMaximum")
    out = dict(node)
    if lower is None and (upper is None or (_is_number(upper) and upper > low)):
        out["exclusiveMinimum" if number else "minimum"] = low
    if upper is None and (lower is None or (_is_number(lower) and lower < high)):
        out["exclusiveMaximum" if number else "maximum"] = high
    if number and step is not None and "multipleOf" not in node:
        out["multipleOf"] = step
    return out


def _check_integers(node: dict, path: str) -> dict:
    """Refuse what makes llguidance crash: an integer in a `const` / `enum` whose nearest double is
    -2**63 (-2**63 .. -2**63 + 512), and an integer range both of whose bounds read as -2**63 or less."""
    for keyword in ("const", "enum"):
        if keyword in node and (value := _lowest_int64(node[keyword])) is not None:
            raise _unbuildable(keyword, value, path)
    if "integer" in _types(node):
        lower, upper = _bound(node, "minimum", "exclusiveMinimum"), _bound(node, "maximum", "exclusiveMaximum")
        if all(_is_number(v) and float(v) <= -(2.0**63) for v in (lower, upper)):
            raise _unbuildable("maximum", upper, path)
    return node


def _lowest_int64(value: Any) -> int | None:
    if isinstance(value, list | dict):
        for item in value.values() if isinstance(value, dict) else value:
            if (found := _lowest_int64(item)) is not None:
                return found
        return None
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return value if is_int and value >= -(2**63) and float(value) == -(2.0**63) else None


def _unbuildable(keyword: str, value: Any, path: str) -> SchemaError:
    return SchemaError(
        f"{keyword!r}: {value} (at {path}) is read by llguidance as the double -2**63 (or below), at which it cannot "
        f"build an integer grammar; use a value of at least {INTEGER_RANGE[0]}",
        keyword=keyword,
        path=path,
    )


def _types(node: dict) -> set:
    declared = node.get("type")
    return {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()


def _bound(node: dict, inclusive: str, exclusive: str) -> Any:
    """The node's bound on one side (its inclusive or exclusive keyword, whatever its value), None if it has none."""
    return node.get(inclusive, node.get(exclusive))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _has_keyword(node: Any, keyword: str) -> bool:
    """`keyword` appears at some schema position (not inside enum, const, default, examples)."""
    found = False

    def look(sub: dict, path: str) -> dict:
        nonlocal found
        found = found or keyword in sub
        return sub

    _map_subschemas(node, look)
    return found


def _map_subschemas(node: Any, rewrite: Callable[[dict, str], dict], path: str = "#") -> Any:
    """`rewrite(subschema, its JSON path)` applied to every subschema, children first; values at data
    positions (enum, const, default, examples, required) are left alone."""
    if isinstance(node, list):
        return [_map_subschemas(v, rewrite, f"{path}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        child = f"{path}/{_escape(key)}"
        if key in _VALUE_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _map_subschemas(sub, rewrite, f"{child}/{_escape(name)}") for name, sub in value.items()}
        else:
            out[key] = _map_subschemas(value, rewrite, child)
    return rewrite(out, path)


def _walk(node: Any, path: str, walk: _Walk, shareable: bool = False) -> Any:
    """Rewrite a subschema; `shareable`: it is a property's or the items' schema, where a `$ref`
    means the same to llguidance (in `oneOf` it would hide the branch's type and be refused)."""
    if isinstance(node, list):
        return [_walk(v, f"{path}/{i}", walk) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        child = f"{path}/{_escape(key)}"
        if key in _VALUE_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rename = _property_pattern(child) if key == "patternProperties" else _same
            out[key] = {
                rename(name): _walk(sub, f"{child}/{_escape(name)}", walk, key == "properties")
                for name, sub in value.items()
            }
        else:
            out[key] = _walk(value, child, walk, key == "items")
    if path != "#" and isinstance(out.get("$id", out.get("id")), str):
        walk.nested_id = True
    return _rewrite_node(out, path, walk, shareable)


def _rewrite_node(node: dict, path: str, walk: _Walk, shareable: bool) -> dict:
    patterns: list[str] = []
    max_length: int | None = None
    check_schema_node(node, path)  # counts and pattern (grammars/limits.py), before any rewrite
    if isinstance(node.get("pattern"), str):
        node["pattern"] = ecma_pattern(node["pattern"])
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt in REFUSED_FORMATS:
        raise _refusal("format", fmt, path, REFUSED_FORMATS[fmt])
    if isinstance(fmt, str) and fmt in EXACT_FORMATS:
        plain = node.get("type") == "string" and set(node) - _ANNOTATIONS <= {"type", "format"}
        if walk.share and shareable and plain:
            walk.shared.add(fmt)
            return {"$ref": f"#/$defs/{SHARED_PREFIX}{fmt}"}
        regex, max_length = EXACT_FORMATS[node.pop("format")]
        patterns.append(regex)
    if walk.draft7:
        patterns += _draft7_content(node, path)
    if not patterns and max_length is None:
        return node
    if max_length is not None:
        current = node.get("maxLength")
        node["maxLength"] = max_length if not isinstance(current, int) else min(current, max_length)
    return _add_patterns(node, [f"^{p}$" for p in patterns])


def _format_schema(fmt: str) -> dict:
    regex, max_length = EXACT_FORMATS[fmt]
    schema: dict[str, Any] = {"type": "string", "pattern": f"^{regex}$"}
    return schema if max_length is None else {**schema, "maxLength": max_length}


def _draft7_content(node: dict, path: str) -> list[str]:
    media = node.get("contentMediaType")
    if isinstance(media, str):
        raise _refusal(
            "contentMediaType",
            media,
            path,
            "draft-07 asserts it, and whether a string is a document of that media type is not "
            "a regular language",
        )
    encoding = node.get("contentEncoding")
    if not isinstance(encoding, str):
        return []
    if encoding.lower() != "base64":
        raise _refusal("contentEncoding", encoding, path, "only base64 is enforced exactly")
    del node["contentEncoding"]
    return [BASE64]


def _add_patterns(node: dict, patterns: list[str]) -> dict:
    if "pattern" not in node:
        node["pattern"], patterns = patterns[0], patterns[1:]
    if patterns:
        all_of = node["allOf"] if isinstance(node.get("allOf"), list) else []
        node["allOf"] = [*all_of, *({"pattern": p} for p in patterns)]
    return node


def _refusal(keyword: str, value: str, path: str, why: str) -> SchemaError:
    return SchemaError(
        f"{keyword!r}: {value!r} is not supported (at {path}): {why}, so the grammar refuses it "
        f"rather than ignoring it; remove {keyword!r} (or use a 'pattern') and check the value "
        "after decoding",
        keyword=keyword,
        path=path,
    )


def _property_pattern(path: str):
    def rename(name: str) -> str:
        check_regex(name, f"'patternProperties' key at {path}:")
        return ecma_pattern(name)

    return rename


def _same(name: str) -> str:
    return name


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")
