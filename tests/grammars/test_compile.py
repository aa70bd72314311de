"""compile(): every spec kind, both tokenizer kinds, padded vocabularies, the cache, and errors."""

from __future__ import annotations

import enum
import typing

import numpy as np
import pytest
from pydantic import BaseModel

from foveal import grammars
from foveal.grammars.bitmask import allowed_tokens as allowed
from foveal.grammars.bitmask import is_allowed
from foveal.grammars.cache import LRUCache

EOS = 2  # SmolLM2's <|im_end|>


def accepts(automaton, text: str, tok) -> bool:
    """Feed the tokenized text token by token; True when every token is allowed and EOS is allowed at the end."""
    m = automaton.matcher()
    for t in tok.encode(text).ids:
        try:
            m.commit(t)
        except grammars.GrammarViolation:
            return False
    return m.is_accepting()


class Point(BaseModel):
    x: int
    y: int
    label: str


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


SPECS = [
    (Point, '{"x": 1, "y": -2, "label": "a b"}', '{"x": 1, "label": "a", "y": 2}'),
    (
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"n": {"type": "integer", "minimum": 0}},
            "type": "object",
            "properties": {"n": {"$ref": "#/definitions/n"}},
            "required": ["n"],
        },
        '{"n": 3}',
        '{"n": -3}',
    ),
    (
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$defs": {"s": {"type": "string", "maxLength": 2}},
            "type": "array",
            "items": {"$ref": "#/$defs/s"},
            "maxItems": 2,
        },
        '["ab", "c"]',
        '["abc"]',
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "number", "maximum": 1}},
            "required": ["a"],
            "additionalProperties": False,
        },
        '{"a": 0.5}',
        '{"a": 1.5}',
    ),
    (grammars.Regex(r"[a-c]{2}\d"), "ab7", "ad7"),
    (grammars.CFG('start: "(" expr ")"\nexpr: /[0-9]+/ | expr "+" expr'), "(1+23)", "(1+)"),
    (typing.Literal["yes", "no"], "yes", "maybe"),
    (typing.Literal[1, 2], "2", "3"),
    (Color, "green", "blue"),
    (["cat", "dog"], "dog", "cow"),
]


@pytest.mark.parametrize(("spec", "good", "bad"), SPECS, ids=lambda v: str(v)[:30])
def test_spec_kinds_accept_their_outputs_only(spec, good, bad, tok):
    a = grammars.compile(spec, tok, eos_token_id=EOS)
    assert accepts(a, good, tok)
    assert not accepts(a, bad, tok)


def test_outlines_output_types(tok):
    from outlines import types

    assert accepts(
        grammars.compile(types.JsonSchema({"type": "integer", "maximum": 5}), tok, eos_token_id=EOS), "5", tok
    )
    assert not accepts(
        grammars.compile(types.JsonSchema('{"type": "integer", "maximum": 5}'), tok, eos_token_id=EOS),
        "6",
        tok,
    )
    assert accepts(grammars.compile(types.Regex("a+b"), tok, eos_token_id=EOS), "aab", tok)
    assert accepts(grammars.compile(types.CFG('start: "x"+'), tok, eos_token_id=EOS), "xxx", tok)
    integer = grammars.compile(int, tok, eos_token_id=EOS)  # outlines maps int to an integer regex
    assert accepts(integer, "-42", tok) and not accepts(integer, "4.2", tok)
    assert accepts(grammars.compile(types.either("ab", "cd"), tok, eos_token_id=EOS), "cd", tok)


def test_transformers_tokenizer_gives_the_same_automaton(tok, smollm2_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert hf.eos_token_id == EOS
    a_hf = grammars.compile(grammars.Regex("ok"), hf)
    a_raw = grammars.compile(grammars.Regex("ok"), tok, eos_token_id=EOS)
    assert a_hf is a_raw  # same vocabulary, EOS and size: one identity, one cache entry


def test_raw_tokenizer_needs_an_eos(tok):
    with pytest.raises(ValueError, match="eos_token_id"):
        grammars.compile(grammars.Regex("x"), tok)


def test_padded_model_vocabulary_never_allows_the_extra_ids(tok):
    a = grammars.compile(grammars.Regex(r"[\s\S]*"), tok, eos_token_id=EOS, vocab_size=49152 + 40)
    bm = np.full((1, (49152 + 40 + 31) // 32), -1, dtype=np.int32)
    a.matcher().fill_mask(bm, 0)
    ids = allowed(bm)
    assert ids.max() < 49152 and len(ids) > 40000


def test_bitmask_width_must_match_the_model_vocabulary(tok):
    a = grammars.compile(grammars.Regex("x"), tok, eos_token_id=EOS)
    with pytest.raises(ValueError, match="vocab_size"):
        a.matcher().fill_mask(np.zeros((1, 1537), dtype=np.int32), 0)
    with pytest.raises(ValueError, match="vocab_size"):
        grammars.fill_masks([a.matcher()], np.zeros((1, 1537), dtype=np.int32))


def test_cache_returns_the_same_automaton_for_equal_specs(tok):
    s1 = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    s2 = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    s3 = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    assert grammars.compile(s1, tok, eos_token_id=EOS) is grammars.compile(s2, tok, eos_token_id=EOS)
    # property order is the output order, so a reordered schema is another automaton
    assert grammars.compile(s3, tok, eos_token_id=EOS) is not grammars.compile(s1, tok, eos_token_id=EOS)
    assert grammars.compile(Point, tok, eos_token_id=EOS) is grammars.compile(Point, tok, eos_token_id=EOS)


def test_lru_drops_the_least_recently_used():
    cache = LRUCache(maxsize=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2


def test_unsupported_keyword_names_keyword_and_path(tok):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(grammars.SchemaError) as err:
        grammars.compile(schema, tok, eos_token_id=EOS)
    assert err.value.keyword == "uniqueItems" and err.value.path == "#/properties/tags"
    assert "'uniqueItems'" in str(err.value) and "#/properties/tags" in str(err.value)


def test_bad_regex_reports_its_position(tok):
    with pytest.raises(grammars.SchemaError, match="position 2") as err:
        grammars.compile(grammars.Regex("ab(c"), tok, eos_token_id=EOS)
    assert err.value.position == "2"


def test_bad_grammar_reports_line_and_column(tok):
    with pytest.raises(grammars.SchemaError, match="line 2, column 6"):
        grammars.compile(grammars.CFG('start: foo\nfoo: "a" | bar\n'), tok, eos_token_id=EOS)


def test_unsupported_spec_kind_is_refused(tok):
    with pytest.raises(grammars.SchemaError, match="wrap it"):
        grammars.compile("a+", tok, eos_token_id=EOS)
    with pytest.raises(grammars.SchemaError, match="unsupported output spec"):
        grammars.compile(object(), tok, eos_token_id=EOS)


def test_json_is_compact_and_leaves_no_room_for_whitespace(tok):
    a = grammars.compile(
        {
            "type": "object",
            "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
            "required": ["a"],
        },
        tok,
        eos_token_id=EOS,
    )
    assert accepts(a, '{"a": [1, 2]}', tok)
    assert not accepts(a, '{"a":[1,2]}', tok)
    assert not accepts(a, '{ "a": [1, 2]}', tok)
    assert not accepts(a, '{"a": [1, 2] }', tok)
    m = a.matcher()
    bm = grammars.allocate_bitmask(1, a.vocab_size)
    for t in tok.encode('{"a": [1,').ids:
        m.commit(t)
    m.fill_mask(bm, 0)
    texts = {tok.decode([int(t)]) for t in allowed(bm)}
    assert " " in texts  # after "," the single separator space, alone or merged with what follows it
    assert all(text[0] == " " and not text[1:].isspace() and not text[1:2].isspace() for text in texts)
    for ws in ("\n", "\t", "  "):
        assert not is_allowed(bm, tok.token_to_id(tok.encode(ws).tokens[0]))


def test_x_guidance_in_a_schema_cannot_loosen_whitespace(tok):
    schema = {"x-guidance": {"whitespace_flexible": True}, "type": "array", "items": {"type": "integer"}}
    assert not accepts(grammars.compile(schema, tok, eos_token_id=EOS), "[1,   2]", tok)


def test_old_drafts_ignore_keywords_next_to_ref(tok):
    """Draft-07: `$ref` siblings are ignored (here: a `maximum` that 2020-12 would apply)."""
    body = {"definitions": {"n": {"type": "integer"}}, "$ref": "#/definitions/n", "maximum": 3}
    old = grammars.compile(
        {"$schema": "http://json-schema.org/draft-07/schema#", **body}, tok, eos_token_id=EOS
    )
    new = grammars.compile(
        {"$schema": "https://json-schema.org/draft/2020-12/schema", **body}, tok, eos_token_id=EOS
    )
    assert accepts(old, "7", tok) and not accepts(new, "7", tok) and accepts(new, "2", tok)


def test_boolean_schemas(tok):
    assert accepts(grammars.compile(True, tok, eos_token_id=EOS), '{"any": [1, "json"]}', tok)
    with pytest.raises(grammars.SchemaError, match="allows no output"):
        grammars.compile(False, tok, eos_token_id=EOS)


class Tag(BaseModel):
    name: str


class Tagged(BaseModel):
    tag: Tag
    tags: list[Tag]


class Loose(BaseModel):
    model_config = {"extra": "allow"}
    name: str


class IntExtras(BaseModel):
    model_config = {"extra": "allow"}
    __pydantic_extra__: dict[str, int]
    name: str


class Ignoring(BaseModel):
    model_config = {"extra": "ignore"}
    name: str


def test_pydantic_classes_allow_no_extra_keys_unless_extra_allow(tok):
    """A class that does not say extra="allow" gets no invented keys, nested or in lists."""
    for spec in (Tag, Ignoring):
        a = grammars.compile(spec, tok, eos_token_id=EOS)
        assert accepts(a, '{"name": "x"}', tok) and not accepts(a, '{"name": "x", "k": 1}', tok)
    a = grammars.compile(Tagged, tok, eos_token_id=EOS)
    assert accepts(a, '{"tag": {"name": "a"}, "tags": [{"name": "b"}]}', tok)
    assert not accepts(a, '{"tag": {"name": "a", "k": 1}, "tags": []}', tok)
    assert not accepts(a, '{"tag": {"name": "a"}, "tags": [{"name": "b", "k": 1}]}', tok)
    assert not accepts(a, '{"tag": {"name": "a"}, "tags": [], "k": 1}', tok)
    a = grammars.compile(list[Tag], tok, eos_token_id=EOS)
    assert accepts(a, '[{"name": "a"}]', tok) and not accepts(a, '[{"name": "a", "k": 1}]', tok)
    # the mask agrees: once the only field is written, the object can only close
    m = grammars.compile(Tag, tok, eos_token_id=EOS).matcher()
    for t in tok.encode('{"name": "x"').ids:
        m.commit(t)
    bm = grammars.allocate_bitmask(1, m.automaton.vocab_size)
    m.fill_mask(bm, 0)
    assert {tok.decode([int(t)]) for t in allowed(bm, 0)} == {"}"}


def test_pydantic_extra_allow_and_json_schema_dicts_keep_extra_keys(tok):
    a = grammars.compile(Loose, tok, eos_token_id=EOS)
    assert accepts(a, '{"name": "x", "k": [1, "y"]}', tok)
    a = grammars.compile(IntExtras, tok, eos_token_id=EOS)
    assert accepts(a, '{"name": "x", "k": 1}', tok) and not accepts(a, '{"name": "x", "k": "y"}', tok)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert accepts(grammars.compile(schema, tok, eos_token_id=EOS), '{"name": "x", "k": 1}', tok)
