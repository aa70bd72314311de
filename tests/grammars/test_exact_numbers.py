"""Numbers llguidance would approximate are refused; the rest are written exactly (grammars/exact_numbers.py).

Invariant 1: every `const` / `enum` number of an accepted schema is written as text that reads back
as the schema's value; invariant 2: every bound of an accepted schema is the one enforced; invariant
3: a refusal is a SchemaError from `compile`, naming keyword and path.
"""

from __future__ import annotations

import json
import random
import typing

import pydantic
import pytest

from foveal import grammars

EOS = 2
BEYOND_DOUBLE = 2**53 + 1  # 9007199254740993: no double holds it
SERDE_MISREAD = (
    0.9043986330300443  # a double whose shortest text llguidance's JSON parser reads one double off
)


class LiteralInt(pydantic.BaseModel):
    x: typing.Literal[9007199254740993]


class LiteralFloat(pydantic.BaseModel):
    x: typing.Literal[0.9043986330300443]


REFUSED = {
    "enum int beyond 2**53": ({"enum": [BEYOND_DOUBLE]}, "enum", "#/enum/0"),
    "enum among exact ones": ({"enum": [1, BEYOND_DOUBLE, 5]}, "enum", "#/enum/1"),
    "const int beyond 2**53": ({"const": BEYOND_DOUBLE}, "const", "#/const"),
    "const int beyond u64": ({"const": 2**64 + 1}, "const", "#/const"),
    "const int beyond 1e22": ({"const": 12345678901234567890123}, "const", "#/const"),
    "const 17-digit float": ({"const": SERDE_MISREAD}, "const", "#/const"),
    "enum 17-digit float": ({"enum": [0.5, 1.2345678901234567e20]}, "enum", "#/enum/1"),
    "const whole float 1e23": ({"const": 1e23}, "const", "#/const"),
    "const inside an object value": ({"const": {"a": [1, BEYOND_DOUBLE]}}, "const", "#/const/a/1"),
    "nested property": (
        {"type": "object", "properties": {"n": {"enum": [BEYOND_DOUBLE]}}},
        "enum",
        "#/properties/n/enum/0",
    ),
    "pydantic Literal int": (LiteralInt, "const", "#/properties/x/const"),
    "pydantic Literal float": (LiteralFloat, "const", "#/properties/x/const"),
    "integer minimum beyond 2**53": ({"type": "integer", "minimum": BEYOND_DOUBLE}, "minimum", "#/minimum"),
    "integer maximum beyond 2**53": (
        {"type": "integer", "maximum": 2**53 + 3},
        "maximum",
        "#/maximum",
    ),
    "number bound misread": ({"type": "number", "minimum": SERDE_MISREAD}, "minimum", "#/minimum"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_number_llguidance_would_approximate_is_refused_at_compile(name, tok):
    spec, keyword, path = REFUSED[name]
    with pytest.raises(grammars.SchemaError) as info:
        grammars.compile(spec, tok, eos_token_id=EOS)
    assert (info.value.keyword, info.value.path) == (keyword, path)
    message = str(info.value)
    assert path in message and "exactly" in message and ("use a value" in message or "use a bound" in message)


def forced_value(spec, tok):
    """The text the grammar forces (a const's whole output), read as JSON."""
    automaton = grammars.compile(spec, tok, eos_token_id=EOS)
    return json.loads(automaton.template.deep_copy().compute_ff_bytes())


EXACT = [
    2**53,
    -(2**53),
    2**60,  # beyond 2**53, but a double holds it
    2**63 - 1,  # the saturating cast of an integer range gives it back
    10**20,
    0.1,
    0.30000000000000004,  # 17 digits, read exactly
    1e22,
    1e-300,
    -0.0,
    {"a": [0.5, 2**60], "b": None},
]


@pytest.mark.parametrize("value", EXACT, ids=repr)
def test_a_number_llguidance_holds_is_written_exactly(value, tok):
    assert forced_value({"const": value}, tok) == value


def test_the_saturated_int64_bound_and_the_layers_own_bounds_are_kept(tok):
    grammars.compile({"type": "integer", "maximum": 2**63 - 1}, tok, eos_token_id=EOS)
    grammars.compile({"type": "integer"}, tok, eos_token_id=EOS)  # [-(2**63 - 1024), 2**63 - 1] added
    grammars.compile({"type": "number"}, tok, eos_token_id=EOS)
    with pytest.raises(
        grammars.SchemaError, match="'maximum': 9007199254740993 .* the double 9007199254740992"
    ):
        grammars.compile({"type": "number", "maximum": BEYOND_DOUBLE}, tok, eos_token_id=EOS)  # no saturation


def test_annotations_are_not_checked(tok):
    grammars.compile(
        {"type": "integer", "default": BEYOND_DOUBLE, "examples": [SERDE_MISREAD]}, tok, eos_token_id=EOS
    )


def test_random_numbers_are_refused_or_written_exactly(tok):
    """Invariant 1 over many values: the forced text of an accepted `const` reads back as the value."""
    rng = random.Random(38)
    values = (
        [rng.randint(-(2**70), 2**70) for _ in range(40)]
        + [rng.randint(-(2**62), 2**62) for _ in range(40)]
        + [rng.random() * 10 ** rng.randint(-30, 30) for _ in range(80)]
        + [float(rng.randint(1, 999)) * 10 ** rng.randint(10, 30) for _ in range(40)]
    )
    accepted = 0
    for value in values:
        try:
            read = forced_value({"const": value}, tok)
        except grammars.SchemaError:
            continue
        assert read == value, value
        accepted += 1
    assert accepted > len(values) // 4  # exact values are not refused wholesale


def test_a_literal_of_exact_text_keeps_its_value(tok):
    # typing.Literal compiles to its exact text (a choice), not through a JSON number.
    automaton = grammars.compile(typing.Literal[BEYOND_DOUBLE], tok, eos_token_id=EOS)
    assert automaton.parse(str(BEYOND_DOUBLE)) == BEYOND_DOUBLE
