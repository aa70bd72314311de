"""Numbers of a JSON schema that llguidance would not hold exactly: refused before compiling.

PROBLEM: llguidance reads every number of a schema as a double: its JSON parser (serde_json without
correct rounding) parses the text, `const` / `enum` numbers and the bounds `minimum`, `maximum`,
`exclusiveMinimum`, `exclusiveMaximum` are then taken `as_f64`, and a `const` is written back as
that double's shortest decimal text, without an exponent. So a number a double does not hold, or one
serde_json rounds to a neighbouring double, is silently approximated:
- `{"enum": [9007199254740993]}` writes 9007199254740992 (2**53 + 1 has no double);
  `{"const": 18446744073709551617}` writes 18446744073709552000;
- `{"const": 0.9043986330300443}` writes 0.9043986330300444: 16 significant digits are a double's
  exact shortest text, but serde_json's parse of them is one double off;
- `{"const": 1e23}` writes 100000000000000000000000, which is not the double 1e23;
- `{"type": "integer", "minimum": 9007199254740993}` admits 9007199254740992.
Each is an output outside the schema, against "valid by construction"; a pydantic `Literal` of such
a value fails only after decoding, when pydantic reads the answer.
SOLUTION: `check_exact_numbers(schema)` finds every number in a `const` / `enum` value (at any depth
of an object or array value) and every numeric bound, at schema positions only (annotations such as
`default` and `examples` are never compiled), and refuses with SchemaError, naming the keyword, its
JSON path and what to do, any number llguidance would not hold exactly:
- integers of magnitude up to 2**53 are exact (an i64 parse, then an exact double);
- other integers within int64: llguidance's double of them is Python's `float(n)` (an i64 parse,
  then the correctly rounded conversion), cast back to an integer with saturation; exact when that
  gives n back (2**60 does; 2**63 - 1 does, through the saturating cast, as an integer's `const` or
  an integer-only node's bound);
- a float whose shortest text has a significand of at most 2**53 and a power of ten of at most 22
  in magnitude is parsed by one correctly rounded operation (Clinger's fast path), so serde_json
  reads it exactly;
- every other number (floats with more digits or larger exponents, integers beyond int64) is read
  back from llguidance itself: a probe schema of those numbers as `const`s, compiled for a byte-level
  tokenizer, forces llguidance's text of each; the number is exact when that text is its value
  (a `const` / `enum` number: the text reads back as the value; a bound: as the same double);
- a `const` / `enum` float that is a whole number beyond 2**53 is written without an exponent as its
  shortest digits padded with zeros, which is exact only when those digits are its value.
INVARIANTS (tests/grammars/test_exact_numbers.py):
1. Every number of a `const` / `enum` of an accepted schema is written by the grammar as text that
   reads back (json.loads) as the schema's value, equal in Python's exact comparison.
2. Every numeric bound of an accepted schema is the double llguidance enforces.
3. A refusal is a SchemaError raised before the schema's own compile, naming keyword and path.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any, Literal, TypeGuard

import llguidance

from .errors import SchemaError

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_VALUE_KEYS = frozenset({"enum", "const", "default", "examples", "required"})
_INT64 = (-(2**63), 2**63 - 1)
_EXACT_INT = 2**53  # every integer of at most this magnitude is a double
_FAST_POWER = 22  # 10**22 is the largest power of ten a double holds exactly
_EXACT = "integers up to 2**53, floats of at most 15 significant digits below 1e22"


@dataclass(frozen=True, slots=True)
class _Number:
    """One number of the schema: where it is, and whether it is a value (const/enum) or a bound."""

    value: int | float
    keyword: str
    path: str
    bound: bool
    integer_only: bool  # a bound of a node whose only numeric type is integer (the saturating cast)


def check_exact_numbers(schema: Any) -> None:
    """Refuse a schema with a number llguidance would not hold exactly (module docstring)."""
    unsure: list[_Number] = []
    for number in _numbers(schema, "#"):
        verdict = _known_verdict(number)
        if verdict is None:
            unsure.append(number)
        elif verdict is not True:
            raise _refusal(number, verdict)
    if not unsure:
        return
    for number, text in zip(unsure, _llguidance_texts([n.value for n in unsure]), strict=True):
        read = json.loads(text)
        if number.bound and float(read) != number.value:
            raise _refusal(number, _double_text(float(read), number.value))
        if not number.bound and read != number.value:
            raise _refusal(number, text)


def _known_verdict(number: _Number) -> Literal[True] | str | None:
    """True: exact; a text: what llguidance makes of it (inexact: the text it writes for a value, the
    double it enforces for a bound); None: ask llguidance (module docstring)."""
    value = number.value
    if isinstance(value, int):
        if abs(value) <= _EXACT_INT:
            return True
        if not _INT64[0] <= value <= _INT64[1]:
            return None
        if number.bound and not number.integer_only:
            return True if float(value) == value else _double_text(float(value), value)
        cast = max(_INT64[0], min(_INT64[1], int(float(value))))
        return True if cast == value else str(cast)
    if not _fast_path(value):
        return None
    if not number.bound and value.is_integer() and abs(value) > _EXACT_INT:
        text = str(int(Decimal(repr(value))))  # the shortest digits, padded with zeros
        return True if Decimal(text) == Decimal(value) else text
    return True


def _double_text(double: float, like: int | float) -> str:
    """A bound's double as its exact integer when the schema wrote an integer, else its shortest text."""
    return str(int(double)) if isinstance(like, int) and double.is_integer() else repr(double)


def _fast_path(value: float) -> bool:
    """serde_json reads `repr(value)` with one correctly rounded operation (Clinger's fast path)."""
    digits, exponent = _significand(repr(value))
    return digits <= _EXACT_INT and abs(exponent) <= _FAST_POWER


def _significand(text: str) -> tuple[int, int]:
    """`text` (a float's repr) as digits * 10**exponent, the digits without trailing zeros."""
    sign, digits, exponent = Decimal(text).normalize().as_tuple()
    return int("".join(map(str, digits)) or "0"), int(exponent)


def _numbers(node: Any, path: str) -> Iterator[_Number]:
    """Every const/enum number and numeric bound at a schema position (never inside annotations)."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _numbers(item, f"{path}/{i}")
        return
    if not isinstance(node, dict):
        return
    if "const" in node:
        yield from _values(node["const"], "const", f"{path}/const")
    if isinstance(node.get("enum"), list):
        for i, item in enumerate(node["enum"]):
            yield from _values(item, "enum", f"{path}/enum/{i}")
    types = node.get("type")
    numeric = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    integer_only = "integer" in numeric and "number" not in numeric
    for keyword in _BOUNDS:
        value = node.get(keyword)
        if _is_number(value):
            yield _Number(value, keyword, f"{path}/{keyword}", bound=True, integer_only=integer_only)
    for key, value in node.items():
        if key in _VALUE_KEYS:
            continue
        child = f"{path}/{_escape(key)}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from _numbers(sub, f"{child}/{_escape(name)}")
        else:
            yield from _numbers(value, child)


def _values(value: Any, keyword: str, path: str) -> Iterator[_Number]:
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield from _values(item, keyword, f"{path}/{i}")
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _values(item, keyword, f"{path}/{_escape(name)}")
    elif _is_number(value):
        yield _Number(value, keyword, path, bound=False, integer_only=False)


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _escape(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _llguidance_texts(values: list[int | float]) -> list[str]:
    """llguidance's text of each number as a `const`: what it holds, asked of llguidance itself."""
    schema = {
        "type": "array",
        "prefixItems": [{"const": v} for v in values],
        "items": False,
        "minItems": len(values),
    }
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema),
        overrides={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    )
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        raise SchemaError(
            f"the schema's numbers could not be read back from llguidance ({matcher.get_error()[:200]}); "
            f"use numbers a double holds exactly ({_EXACT})"
        )
    forced = matcher.compute_ff_bytes().decode()
    # Every number is a const, so the whole array is forced: "[" text "," text ... "]".
    texts = forced[1:-1].split(",") if forced.endswith("]") else []
    if len(texts) != len(values):
        raise SchemaError(
            "the schema's numbers could not be read back from llguidance (its text of them was not forced "
            f"whole); use numbers a double holds exactly ({_EXACT})"
        )
    return texts


class _Bytes:
    """A vocabulary of the 256 bytes and an EOS: a probe's forced text does not depend on a model's."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _refusal(number: _Number, reading: str) -> SchemaError:
    value = number.value
    if len(reading) > 40:  # 1e300's text is 301 digits: its head and its length say enough
        reading = f"{reading[:20]}... ({len(reading)} characters)"
    if number.bound:
        why = f"llguidance reads it as the double {reading}, so the grammar would enforce a different bound"
        advice = (
            f"use a bound a double holds exactly (e.g. {_nearby(number)}) and check the value after decoding"
        )
    else:
        why = f"llguidance holds it as a double and would write {reading} instead"
        advice = f'use a value a double holds exactly ({_EXACT}), or a string ("{value!r}") that you convert after decoding'
    return SchemaError(
        f"{number.keyword!r}: {value!r} (at {number.path}) cannot be enforced exactly: {why}; {advice}",
        keyword=number.keyword,
        path=number.path,
    )


def _nearby(number: _Number) -> str:
    """A bound of at most 15 significant digits on the narrowing side of the given one (a double holds it)."""
    value = Decimal(number.value)
    lower = number.keyword in ("minimum", "exclusiveMinimum")
    step = Decimal(1).scaleb(value.adjusted() - 14)  # the 15th significant digit
    rounded = value.quantize(step, rounding=ROUND_CEILING if lower else ROUND_FLOOR)
    return repr(float(rounded)) if isinstance(number.value, float) else str(int(rounded))
