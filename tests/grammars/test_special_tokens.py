"""A user grammar that names a token directly is refused at compile time (grammars/special_tokens.py).

Invariant 1: by name, id, range or wildcard, whatever the tokenizer has, SchemaError from `compile`;
invariant 2: `<...>` as text (strings, regexes, comments, `%json` bodies) compiles as before.
"""

from __future__ import annotations

import pytest

from foveal import grammars

EOS = 2

NAMED = {
    "the tokenizer's EOS by name": ('start: "a" <|im_end|>', "<|im_end|>", "line 1, column 12"),
    "another special token": ('start: <|endoftext|> "a"', "<|endoftext|>", "line 1, column 8"),
    "an added location token": ('start: "a" <loc0001>', "<loc0001>", "line 1, column 12"),
    "a token id": ('start: "a" <[2]>', "<[2]>", "line 1, column 12"),
    "a range of ids": ('start: "a" <[1-3,5]>', "<[1-3,5]>", "line 1, column 12"),
    "every token": ('start: "a"\n     | <[*]> "b"', "<[*]>", "line 2, column 8"),
    "a name the tokenizer lacks": ('start: "a" <eos>', "<eos>", "line 1, column 12"),
    "inside a nested %lark grammar": ('start: "a" %lark {\n  start: <eos>\n}', "<eos>", "line 2, column 10"),
}


@pytest.mark.parametrize("name", NAMED)
def test_a_token_named_in_a_grammar_is_refused_at_compile(name, loc_tok):
    grammar, token, where = NAMED[name]
    with pytest.raises(grammars.SchemaError) as info:
        grammars.compile(grammars.CFG(grammar), loc_tok, eos_token_id=EOS)
    message = str(info.value)
    assert token in message and where in message and info.value.position == where
    assert "remove it" in message and f'"{token}"' in message  # says what to write instead
    assert "following special tokens are available" not in message  # not llguidance's list of every one


TEXT = [
    'start: "<eos>" "<|im_end|>"',
    'start: "a\\"<eos>"',
    "start: A\nA: /<think>[a-z]*<\\/think>/",
    'start: "a" // <eos> in a comment\n# <|im_end|> too\n',
    'start: "a" x\nx: %json {"type": "string", "const": "<eos>"}',
    'start: "a" | "b"',
]


@pytest.mark.parametrize("grammar", TEXT)
def test_tag_like_text_in_strings_regexes_comments_and_json_compiles(grammar, loc_tok):
    grammars.compile(grammars.CFG(grammar), loc_tok, eos_token_id=EOS)


def test_an_outlines_cfg_is_checked_too(loc_tok):
    from outlines import types

    with pytest.raises(grammars.SchemaError, match="names a token directly"):
        grammars.compile(types.CFG('start: "a" <|im_end|>'), loc_tok, eos_token_id=EOS)
