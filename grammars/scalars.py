"""Python scalar types as output specs: an exact regex and the parser of its text, per type.

PROBLEM: outlines maps int, float, bool, date, time and datetime to regexes that are looser than
the parsers the values are read with: `\\d{4}` allows year 0000 (and, read by Rust, any Unicode
digit), `\\s` lets a newline separate date and time, day 31 is allowed in every month, and an int
may have more digits than `int()` converts. A model sampling under such a mask could emit text the
parser then refuses, after all the decoding work (e.g. `'0000-11-10\\n00:57:57'`).
SOLUTION: our own regex per type, written so that every string it accepts is one its parser reads,
and the parser carried with it (`ScalarType.parse`). Numbers are bounded, so a model cannot write
digits until the context is full: `int` is exactly the int64 range (-2**63 .. 2**63 - 1, a regex
states it exactly), `float` has the limits of JSON numbers (grammars/formats.py): |x| < 10**15, at
most 10 fraction digits, no exponent.
INVARIANTS (tests/grammars/test_valid_by_construction.py walks the masks and parses the walks;
tests/grammars/test_numbers.py the bounds):
1. Every string the regex accepts parses with `parse`, to a value of the type.
2. The regexes use only ASCII classes (no `\\d`, `\\s`), so llguidance and Python read them alike.
3. `int_range(lo, hi)` matches exactly the decimal integers in [lo, hi]; `int` accepts -2**63 and
   2**63 - 1 and refuses one past either.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .formats import DATE, NUMBER_FRACTION_DIGITS, NUMBER_INTEGER_DIGITS

_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"


@dataclass(frozen=True, slots=True)
class ScalarType:
    """One scalar type: the regex of its text and the parser of that text."""

    regex: str
    parse: Callable[[str], Any]


def int_range(lo: int, hi: int) -> str:
    """Regex of the decimal integers in [lo, hi] (0 <= lo <= hi), without leading zeros."""
    if not 0 <= lo <= hi:
        raise ValueError(f"empty or negative range [{lo}, {hi}]")
    alternatives = []
    for width in range(len(str(lo)), len(str(hi)) + 1):
        first = max(lo, 10 ** (width - 1) if width > 1 else 0)
        last = min(hi, 10**width - 1)
        if first <= last:
            alternatives.append(_same_width(str(first), str(last)))
    return "(" + "|".join(alternatives) + ")"


def _same_width(a: str, b: str) -> str:
    """Regex of the digit strings of len(a) == len(b) between a and b inclusive."""
    if not a:
        return ""
    if set(a) == {"0"} and set(b) == {"9"}:
        return f"[0-9]{{{len(a)}}}"
    if a[0] == b[0]:
        return a[0] + _same_width(a[1:], b[1:])
    rest = len(a) - 1
    parts = [a[0] + _same_width(a[1:], "9" * rest)]
    if int(b[0]) - int(a[0]) > 1:
        parts.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    parts.append(b[0] + _same_width("0" * rest, b[1:]))
    return "(" + "|".join(parts) + ")"


INT64 = f"(?:-{int_range(1, 2**63)}|{int_range(0, 2**63 - 1)})"
# the limits of JSON numbers (grammars/formats.py): 15 integer digits, 10 fraction digits
FLOAT = f"-?(?:0|[1-9][0-9]{{0,{NUMBER_INTEGER_DIGITS - 1}}})(?:[.][0-9]{{1,{NUMBER_FRACTION_DIGITS}}})?"


def _bool(text: str) -> bool:
    return text == "True"


SCALARS: dict[type, ScalarType] = {
    int: ScalarType(INT64, int),
    float: ScalarType(FLOAT, float),
    bool: ScalarType("True|False", _bool),
    datetime.date: ScalarType(DATE, datetime.date.fromisoformat),
    datetime.time: ScalarType(_TIME, datetime.time.fromisoformat),
    # str(datetime) writes a space, isoformat() a "T": both are read by fromisoformat.
    datetime.datetime: ScalarType(f"{DATE}[T ]{_TIME}", datetime.datetime.fromisoformat),
}
