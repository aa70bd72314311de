"""Numbers under a grammar: no integer or number can grow until the context is full.

Invariants 5 and 6 of grammars/formats.py (JSON integers and numbers, on every path a JSON schema comes
from), and invariant 3 of grammars/scalars.py (`int` and `float` as output types).
"""

from __future__ import annotations

import json
import re

import llguidance
import numpy as np
import pydantic
import pytest
from outlines import types

from foveal import grammars
from foveal.grammars.formats import INTEGER_RANGE, bounded_numbers
from foveal.grammars.scalars import int_range
from foveal.grammars.specs import JSON_OPTIONS

EOS = 2
LOWEST, HIGHEST = INTEGER_RANGE


def accepts(automaton, text: str, tok) -> bool:
    """The whole text, then EOS, commits: the grammar accepts it as a complete output."""
    matcher = automaton.matcher()
    try:
        for token in tok.encode(text, add_special_tokens=False).ids:
            matcher.commit(token)
        matcher.commit(EOS)
    except grammars.GrammarViolation:
        return False
    return True


class Count(pydantic.BaseModel):
    n: int
    maybe: int | None = None


class Reading(pydantic.BaseModel):
    value: float


INTEGER_SPECS = {
    "schema dict": ({"type": "integer"}, "{}"),
    "outlines JsonSchema": (types.JsonSchema({"type": "integer"}), "{}"),
    "outlines JsonSchema text": (types.JsonSchema('{"type": "integer"}'), "{}"),
    "pydantic int field": (Count, '{{"n": {}}}'),
    "pydantic Optional[int]": (Count, '{{"n": 0, "maybe": {}}}'),
    "list[int]": (list[int], "[1, {}]"),
    "dict[str, int]": (dict[str, int], '{{"a": {}}}'),
    "nested $defs": ({"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}}, "[{}]"),
}


@pytest.mark.parametrize("name", INTEGER_SPECS)
def test_unbounded_integers_keep_to_the_int64_range(name, tok):
    """The highest int64 and the lowest value llguidance can bound exactly are accepted, one past either
    is refused; the reported 400-digit integer is refused."""
    spec, template = INTEGER_SPECS[name]
    automaton = grammars.compile(spec, tok, eos_token_id=EOS)
    text = template.format if template != "{}" else "{}".format
    for value in (0, -7, 42, HIGHEST, LOWEST, 2**53 + 1):
        assert accepts(automaton, text(value), tok), (name, value)
    for value in (HIGHEST + 1, LOWEST - 1, -(2**63), int("1" * 400)):
        assert not accepts(automaton, text(value), tok), (name, value)


def test_the_int64_range_is_all_of_it_but_its_lowest_1024_values():
    assert HIGHEST == 2**63 - 1 and LOWEST == -(2**63) + 1024
    assert float(LOWEST) == LOWEST and float(HIGHEST) == 2.0**63  # llguidance reads bounds as doubles


NUMBER_SPECS = {
    "schema dict": ({"type": "number"}, "{}"),
    "pydantic float field": (Reading, '{{"value": {}}}'),
    "list[float]": (list[float], "[{}]"),
}


@pytest.mark.parametrize("name", NUMBER_SPECS)
def test_unbounded_numbers_have_at_most_15_integer_and_10_fraction_digits(name, tok):
    spec, template = NUMBER_SPECS[name]
    automaton = grammars.compile(spec, tok, eos_token_id=EOS)
    text = template.format if template != "{}" else "{}".format
    for value in ("0", "-0.5", "1.0", "999999999999999", "-999999999999999.9999999999", "0.0000000001", "3.25"):
        assert accepts(automaton, text(value), tok), (name, value)
    for value in ("1000000000000000", "-1000000000000000", "0.12345678901", "1.00000000000", "1e5", "1" * 400):
        assert not accepts(automaton, text(value), tok), (name, value)


def _llguidance_accepts(schema: dict, text: str, tok) -> bool:
    """The schema compiled by llguidance as it stands, without foveal's rewrites."""
    from foveal.grammars.tokenizer import tokenizer_handle

    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(tokenizer_handle(tok, eos_token_id=EOS).ll, grammar, log_level=0)
    ids = [*tok.encode(text, add_special_tokens=False).ids, EOS]
    return matcher.validate_tokens(ids) == len(ids)


GIVEN_BOUNDS = [
    {"type": "integer", "minimum": 5},
    {"type": "integer", "exclusiveMaximum": -5},
    {"type": "integer", "minimum": -3, "maximum": 12},
    {"type": ["integer", "null"], "maximum": 100},
    {"type": "number", "minimum": 0.5},
    {"type": "number", "exclusiveMaximum": 2},
    {"type": "number", "multipleOf": 0.25},
    {"type": "integer", "multipleOf": 3},
]
PROBES = ["-12", "-6", "-5", "-4", "-3", "0", "0.25", "0.5", "0.75", "1", "1.5", "2", "3", "4", "5", "6", "12",
          "13", "100", "101", "123456789", "-123456789", "0.1234567891", "null"]


@pytest.mark.parametrize("schema", GIVEN_BOUNDS, ids=json.dumps)
def test_bounds_the_schema_gives_are_kept(schema, tok):
    """Invariant 6: within the ranges, the grammar accepts exactly what llguidance accepted before."""
    automaton = grammars.compile(schema, tok, eos_token_id=EOS)
    for text in PROBES:
        assert accepts(automaton, text, tok) == _llguidance_accepts(schema, text, tok), text


def test_the_other_side_is_bounded_where_the_schema_gives_one(tok):
    at_least_5 = grammars.compile({"type": "integer", "minimum": 5}, tok, eos_token_id=EOS)
    assert accepts(at_least_5, str(HIGHEST), tok) and not accepts(at_least_5, str(HIGHEST + 1), tok)
    below = grammars.compile({"type": "number", "maximum": -2}, tok, eos_token_id=EOS)
    assert accepts(below, "-999999999999999", tok) and not accepts(below, "-1000000000000000", tok)


def test_a_bound_outside_the_range_leaves_the_node_satisfiable(tok):
    """`minimum: 1e16` on a number: an upper bound of 1e15 would allow nothing, so none is added."""
    automaton = grammars.compile({"type": "number", "minimum": 1e16}, tok, eos_token_id=EOS)
    assert accepts(automaton, "1" + "0" * 16, tok) and not accepts(automaton, "1" + "0" * 15, tok)


def test_a_schema_with_its_own_multiple_of_keeps_compiling_to_it(tok):
    """llguidance intersects two multipleOf through a common denominator that overflows for 1e-10 and then
    accepts nothing: a schema with a multipleOf anywhere gets none of ours."""
    schema = {"allOf": [{"type": "number"}, {"multipleOf": 0.5}]}
    automaton = grammars.compile(schema, tok, eos_token_id=EOS)
    assert accepts(automaton, "1.5", tok) and not accepts(automaton, "1.25", tok)
    assert not accepts(automaton, "1" + "0" * 15, tok)  # the integer digits are still bounded


@pytest.mark.parametrize(
    "schema",
    [
        {"const": -9223372036854775807},
        {"enum": [1, -(2**63)]},
        {"type": "array", "items": {"const": {"a": [-(2**63) + 100]}}},
        {"type": "integer", "minimum": -1e19, "maximum": -1e19},
    ],
    ids=json.dumps,
)
def test_integers_llguidance_cannot_build_are_refused_not_crashed_on(schema, tok):
    """llguidance reads these as the double -2**63 and crashes the process (SIGSEGV) compiling them."""
    with pytest.raises(grammars.SchemaError, match="double -2\\*\\*63"):
        grammars.compile(schema, tok, eos_token_id=EOS)
    grammars.compile({"const": -9223372036854774784}, tok, eos_token_id=EOS)  # the next double up is fine


@pytest.fixture(scope="module")
def digit_tokens(tok) -> np.ndarray:
    return np.array([t.isdigit() for t in (tok.decode([i]) for i in range(tok.get_vocab_size()))])


def _digit_loving_walk(automaton, tok, digits, rng, max_tokens: int = 120) -> tuple[str, bool]:
    """A walk under the mask that writes a digit whenever one is allowed (9 times in 10): the model that
    filled its context with a 400-digit integer. Returns its text and whether it completed."""
    matcher = automaton.matcher()
    bitmask = grammars.allocate_bitmask(1, automaton.vocab_size)
    tokens: list[int] = []
    while len(tokens) < max_tokens and not matcher.is_terminated():
        matcher.fill_mask(bitmask, 0)
        allowed = grammars.bitmask.allowed_tokens(bitmask, 0)
        numeric = allowed[digits[allowed]]
        token = int(rng.choice(numeric if len(numeric) and rng.random() < 0.9 else allowed))
        matcher.commit(token)
        if token == EOS:
            break
        tokens.append(token)
    return tok.decode(tokens), matcher.is_terminated()


@pytest.mark.parametrize(
    ("schema", "digits"), [({"type": "integer"}, 19), ({"type": "number"}, 15), (Count, 19)], ids=str
)
def test_walks_that_love_digits_still_end_in_bounded_numbers(schema, digits, tok, digit_tokens):
    """Every such walk completes within 120 tokens, parses, and no number has more digits than allowed."""
    automaton = grammars.compile(schema, tok, eos_token_id=EOS)
    rng = np.random.default_rng(11)
    for _ in range(20):
        text, complete = _digit_loving_walk(automaton, tok, digit_tokens, rng)
        assert complete, text
        automaton.parse(text)
        for number in re.findall(r"-?[0-9][0-9.]*", text):
            whole, _, fraction = number.lstrip("-").partition(".")
            assert len(whole) <= digits and len(fraction) <= 10, text


def test_the_int_output_type_is_exactly_int64(tok):
    automaton = grammars.compile(int, tok, eos_token_id=EOS)
    for value in (0, -1, 2**63 - 1, -(2**63)):
        assert accepts(automaton, str(value), tok), value
    for value in (2**63, -(2**63) - 1, int("9" * 400)):
        assert not accepts(automaton, str(value), tok), value


def test_the_float_output_type_has_the_limits_of_json_numbers(tok):
    automaton = grammars.compile(float, tok, eos_token_id=EOS)
    assert accepts(automaton, "999999999999999.0123456789", tok) and accepts(automaton, "-0.5", tok)
    for text in ("1000000000000000", "0.12345678901", "1e5"):
        assert not accepts(automaton, text, tok), text


@pytest.mark.parametrize(("lo", "hi"), [(0, 0), (1, 9), (10**18, 2**63), (2**63 - 10, 2**63 - 1)])
def test_int_range_is_exact_at_its_ends(lo, hi):
    pattern = re.compile(int_range(lo, hi))
    for n in (lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, 10 * hi):
        assert bool(pattern.fullmatch(str(n))) == (lo <= n <= hi), n


def test_a_typeless_or_finite_node_is_left_alone_and_the_input_is_not_mutated():
    for schema in ({}, {"minimum": 3}, {"type": "integer", "enum": [1, 2]}, {"type": "number", "const": 2.5}):
        assert bounded_numbers(schema) == schema
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "default": {"n": {"type": "integer"}}}
    before = json.dumps(schema)
    out = bounded_numbers(schema)
    assert json.dumps(schema) == before and out["default"] == schema["default"]  # data positions untouched
    assert out["properties"]["n"] == {"type": "integer", "minimum": LOWEST, "maximum": HIGHEST}
