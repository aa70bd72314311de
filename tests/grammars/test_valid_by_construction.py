"""Valid by construction (issue 13): whatever a spec's mask lets a model emit, the spec's parser reads;
a spec that would fail or stall mid-decode is refused by `compile` with a message naming the cause."""

from __future__ import annotations

import datetime
import enum
import json
import time
import typing

import numpy as np
import pytest

from foveal import grammars
from foveal.grammars.bitmask import allocate_bitmask
from foveal.grammars.compiler import parser_of
from foveal.grammars.limits import MAX_FORCED_BYTES
from foveal.grammars.walk import random_walk

EOS = 2


class Colour(enum.Enum):
    RED = "red"
    ONE = 1


SCALAR_AND_CHOICE_TYPES = [
    int,
    float,
    bool,
    datetime.date,
    datetime.time,
    datetime.datetime,
    Colour,
    typing.Literal["a", 2, True, None],
    ["x|y", "a/b", "new\nline", "(", "<|im_end|>"],
]


@pytest.mark.parametrize("spec", SCALAR_AND_CHOICE_TYPES, ids=repr)
def test_every_walk_under_the_mask_parses(spec, tok):
    """Random walks through the masks (what a sampling model can emit) all parse to the type."""
    automaton = grammars.compile(spec, tok, eos_token_id=EOS)
    rng = np.random.default_rng(13)
    for _ in range(150):
        walk = random_walk(automaton, rng, max_tokens=40, pull=0.05)
        if not walk.terminated:
            continue  # cut short: the caller raises "raise max_tokens", not a parse error
        value = automaton.parse(tok.decode(walk.tokens))
        if isinstance(spec, type) and not issubclass(spec, enum.Enum):
            assert type(value) is spec


@pytest.mark.parametrize(
    "spec, text",
    [
        (datetime.datetime, "0000-11-10\n00:57:57"),  # the reported output
        (datetime.datetime, "2021-11-10\t00:57:57"),
        (datetime.date, "0000-01-01"),
        (datetime.date, "2023-02-29"),
        (datetime.date, "٢٠٢١-01-01"),  # Unicode digits, which Rust's \d accepts
        (int, "1" * 5000),  # more digits than int() converts
        (bool, "true"),
    ],
)
def test_scalar_grammars_refuse_what_their_parser_refuses(spec, text, tok):
    m = grammars.compile(spec, tok, eos_token_id=EOS).matcher()
    with pytest.raises(grammars.GrammarViolation):
        for t in tok.encode(text, add_special_tokens=False).ids:
            m.commit(t)
        m.commit(EOS)


def test_choices_whose_texts_coincide_are_refused(tok):
    with pytest.raises(grammars.SchemaError, match="both written '1'"):
        grammars.compile(typing.Literal[1, "1"], tok, eos_token_id=EOS)


def test_five_thousand_choices_decode(tok):
    for spec in (
        [f"w{i}" for i in range(5000)],
        grammars.CFG("start: " + " | ".join(f'"w{i}"' for i in range(5000))),
    ):
        automaton = grammars.compile(spec, tok, eos_token_id=EOS)
        walk = random_walk(automaton, np.random.default_rng(0), max_tokens=20)
        assert walk.terminated and not walk.limit, walk


def test_typing_typeddict_is_a_clear_schema_error(tok):
    class Point(typing.TypedDict):
        x: int

    with pytest.raises(grammars.SchemaError, match="typing_extensions"):
        grammars.compile(Point, tok, eos_token_id=EOS)


# --- special-token text is plain text ---------------------------------------------------------


@pytest.mark.parametrize("spec", [grammars.Regex(r"<\|im_end\|>x"), grammars.CFG('start: "<|im_end|>x"')])
def test_special_token_text_is_spelled_with_plain_tokens(spec, tok):
    """The mask never offers the special token for its text, so commit never refuses what mask allowed."""
    automaton = grammars.compile(spec, tok, eos_token_id=EOS)
    walk = random_walk(automaton, np.random.default_rng(0))
    assert walk.terminated and EOS not in walk.tokens and len(walk.tokens) > 2
    assert tok.decode(walk.tokens, skip_special_tokens=False) == "<|im_end|>x"


def test_special_token_text_in_json_strings(tok):
    automaton = grammars.compile({"const": "<|im_start|>"}, tok, eos_token_id=EOS)
    walk = random_walk(automaton, np.random.default_rng(0))
    assert walk.terminated and 1 not in walk.tokens
    assert json.loads(tok.decode(walk.tokens)) == "<|im_start|>"


def test_lark_naming_a_special_token_is_refused(tok):
    # The engine cannot decode through a control token as written (grammars/special_tokens.py).
    with pytest.raises(grammars.SchemaError, match="names a token directly"):
        grammars.compile(grammars.CFG('start: <|im_start|> "x"'), tok, eos_token_id=EOS)


# --- refused at compile time, in our words ------------------------------------------------------


@pytest.mark.parametrize(
    "spec, cause",
    [
        ({"$ref": "#"}, "no output satisfies it"),
        (
            {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
            "base case",
        ),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "base case"),
        (grammars.CFG('start: "a" start'), "base case"),
        (grammars.Regex("a{100000}"), "repetition of at least 100,000"),
        (grammars.Regex("x" * 5000), "fixed text"),
        ({"const": "x" * 5000}, "fixed text"),
        ({"type": "string", "minLength": 100000}, "'minLength': 100,000"),
        ({"type": "integer", "minimum": 10**30}, "'minimum' .at #. is too large"),
        ({"properties": {"n": {"type": "number", "maximum": -1e30}}}, "'maximum' .at #/properties/n."),
        (grammars.Regex("\\"), "lone backslash"),
        (grammars.Regex("a**"), "quantifier follows a quantifier"),
        (grammars.Regex("a{1,2000000}"), "up to 2,000,000"),
        ({"type": "string", "pattern": "a++"}, "'pattern' at #"),
        ({"patternProperties": {"\\": {}}}, "'patternProperties' key at #/patternProperties"),
    ],
)
def test_specs_that_would_fail_mid_decode_are_refused_at_compile(spec, cause, tok):
    with pytest.raises(grammars.SchemaError, match=cause) as err:
        grammars.compile(spec, tok, eos_token_id=EOS)
    internal = ("NoExtensionBias", "Failed to generate", "regex parse error", "decimal literal", "<state>")
    assert not any(words in str(err.value) for words in internal), err.value


def test_valid_regexes_still_compile(tok):
    for pattern in (r"a*?", r"a{2}?", r"[*+]{2}", r"\\", r"x{3,}", r"[[:alpha:]]+", r"\{a\}"):
        grammars.compile(grammars.Regex(pattern), tok, eos_token_id=EOS)


def test_unreachable_upper_bounds_are_lowered_not_refused(tok):
    automaton = grammars.compile({"type": "string", "maxLength": 10**12}, tok, eos_token_id=EOS)
    walk = random_walk(automaton, np.random.default_rng(0), max_tokens=50)
    assert walk.terminated and isinstance(json.loads(tok.decode(walk.tokens)), str)


def test_an_accepted_spec_keeps_each_mask_step_cheap(tok):
    """The noisy neighbour: the longest run of forced text a spec may have costs ~1 ms a step."""
    automaton = grammars.compile(grammars.Regex(f"a{{{MAX_FORCED_BYTES}}}"), tok, eos_token_id=EOS)
    m = automaton.matcher()
    bitmask = allocate_bitmask(1, automaton.vocab_size)
    m.fill_mask(bitmask, 0)  # the lexer's first build
    timings = []
    for _ in range(10):
        start = time.perf_counter()
        m.fill_mask(bitmask, 0)
        timings.append(time.perf_counter() - start)
        m.commit(m.forced_tokens()[0])
    assert np.median(timings) < 0.02  # measured ~0.5 ms; 20 ms leaves room for a busy machine


# --- the compiled spec carries its parser ------------------------------------------------------


def test_automaton_parse_is_the_output_parser(tok):
    cases = {
        grammars.Regex("a+"): ("aa", "aa"),
        "json": ('{"a": 1}', {"a": 1}),
        Colour: ("1", Colour.ONE),
        int: ("-12", -12),
        datetime.datetime: ("2024-02-29 10:00:00", datetime.datetime(2024, 2, 29, 10)),
        list[int]: ("[1, 2]", [1, 2]),
    }
    for spec, (text, value) in cases.items():
        spec = {"type": "object"} if spec == "json" else spec
        assert grammars.compile(spec, tok, eos_token_id=EOS).parse(text) == value
        assert parser_of(spec)(text) == value
    spatial = grammars.spatial.points("json", max_objects=2)
    text = '{"points": [{"x": 0.5, "y": 0.25}]}'
    assert grammars.compile(spatial, tok, eos_token_id=EOS).parse(text) == parser_of(spatial)(text)


def test_added_tokens_not_flagged_special_are_spelled_with_plain_tokens_too(smollm2_dir):
    """PaliGemma's `<segNNN>` are added tokens without the special flag: the grammar layer's encoder is
    then a rebuilt copy that flags them; where every such token is flagged (SmolLM2's own), the layer's
    private copy of the tokenizer serves as the encoder (grammars/tokenizer.py)."""
    from tokenizers import Tokenizer

    from foveal.grammars.tokenizer import tokenizer_handle

    plain = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    flagged = tokenizer_handle(plain, eos_token_id=EOS)
    assert flagged.source.encode_special_tokens  # the fast path: the private copy reads them as text
    assert not plain.encode_special_tokens  # the caller's tokenizer is left as it was

    seg = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    seg.add_tokens(["<seg007>"])  # an added token, not special
    seg_id = seg.token_to_id("<seg007>")
    automaton = grammars.compile(grammars.Regex(r"<seg007>x"), seg, eos_token_id=EOS)
    walk = random_walk(automaton, np.random.default_rng(0))
    assert walk.terminated and seg_id not in walk.tokens and len(walk.tokens) > 2
    assert seg.decode(walk.tokens, skip_special_tokens=False) == "<seg007>x"
