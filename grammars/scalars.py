"""Python scalar types as output specs: an exact regex and the parser of its text, per type.

PROBLEM: outlines maps int, float, bool, date, time and datetime to regexes that are looser than
the parsers the values are read with: `\\d{4}` allows year 0000 (and, read by Rust, any Unicode
digit), `\\s` lets a newline separate date and time, day 31 is allowed in every month, and an int
may have more digits than `int()` converts. A model sampling under such a mask could emit text the
parser then refuses, after all the decoding work (e.g. `'0000-11-10\\n00:57:57'`).
SOLUTION: our own regex per type, written so that every string it accepts is one its parser reads,
and the parser carried with it (`ScalarType.parse`).
INVARIANTS (tests/grammars/test_valid_by_construction.py walks the masks and parses the walks):
1. Every string the regex accepts parses with `parse`, to a value of the type.
2. The regexes use only ASCII classes (no `\\d`, `\\s`), so llguidance and Python read them alike.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .formats import DATE

# int() refuses longer decimal strings (Python's integer string conversion limit).
MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"


@dataclass(frozen=True, slots=True)
class ScalarType:
    """One scalar type: the regex of its text and the parser of that text."""

    regex: str
    parse: Callable[[str], Any]


def _bool(text: str) -> bool:
    return text == "True"


SCALARS: dict[type, ScalarType] = {
    int: ScalarType(f"-?(?:0|[1-9][0-9]{{0,{MAX_INT_DIGITS - 1}}})", int),
    float: ScalarType("-?(?:0|[1-9][0-9]*)(?:[.][0-9]+)?(?:[eE][+-]?[0-9]+)?", float),
    bool: ScalarType("True|False", _bool),
    datetime.date: ScalarType(DATE, datetime.date.fromisoformat),
    datetime.time: ScalarType(_TIME, datetime.time.fromisoformat),
    # str(datetime) writes a space, isoformat() a "T": both are read by fromisoformat.
    datetime.datetime: ScalarType(f"{DATE}[T ]{_TIME}", datetime.datetime.fromisoformat),
}
