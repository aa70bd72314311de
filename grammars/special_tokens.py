"""Special-token references in a user's Lark grammar: refused before llguidance compiles it.

PROBLEM: llguidance's Lark dialect lets a rule name a token directly: `<eos>`, `<|im_end|>`, a token id
`<[2]>`, a range `<[100-200]>` or every token `<[*]>`. The grammar compiles, but the engine cannot
decode through such a token as written: the EOS token ends the request (the engine commits it as a
stop, and the automaton then refuses it as a grammar token: a 500 `generation_error` whose message
holds the engine's internals), a control token such as `<bos>` is dropped from the answer's text (the
output no longer reads as the grammar says), and an id names whatever token the model has there.
Whether `<name>` compiles at all depends on the tokenizer (a name it lacks is refused with a list of
every special token it has), so the same grammar failed differently per model.
SOLUTION: `refuse_special_tokens(grammar)` scans the grammar as llguidance's Lark lexer reads it
(parser/src/lark/lexer.rs): comments (`#`, `//`), strings (`"..."`, JSON escapes), regexes (`/.../`)
and the JSON bodies of `%json`, `%regex` and `%llguidance` are skipped, and a special-token lexeme
(`<` then characters other than `<`, `>` and whitespace, then `>`) anywhere else, nested `%lark`
grammars included, raises SchemaError naming it, its line and column, and what to write instead.
Text that merely looks like a tag, `"<tool_call>"` or `/<think>/`, is a string or a regex and is kept.
INVARIANTS (tests/grammars/test_special_tokens.py):
1. A grammar that names a token, by name, id, range or wildcard, raises SchemaError from `compile`
   before llguidance sees it, whatever the tokenizer.
2. `<...>` inside strings, regexes, comments and `%json` bodies is text and compiles as before.
"""

from __future__ import annotations

import json
import re

from .errors import SchemaError

# The lexemes of parser/src/lark/lexer.rs that can hold `"`, `/`, `#` or `<`; every other lexeme is
# made of characters none of those, so the scan may step over it one character at a time.
_STRING = re.compile(r'"(?:\\(?:["\\/bfnrt]|u[a-fA-F0-9]{4}|x[a-fA-F0-9]{2})|[^"\\\x00-\x1f\x7f])*"i?')
_REGEXP = re.compile(r"/(?:\\.|[^/\\])+/[imslux]*", re.S)
_COMMENT = re.compile(r"(?:#|//)[^\n]*")
_SPECIAL = re.compile(r"<[^<>\s]+>")
_JSON_BODY = re.compile(r"%(?:json|regex|llguidance)(?![A-Za-z0-9_])\s*")
_DECODER = json.JSONDecoder()


def refuse_special_tokens(grammar: str) -> None:
    """Raise SchemaError for the first special-token reference in a Lark grammar (module docstring)."""
    if "<" not in grammar:
        return
    i = 0
    while i < len(grammar):
        c = grammar[i]
        found = None
        if c == '"':
            found = _STRING.match(grammar, i)
        elif c == "/" or c == "#":
            found = (
                _COMMENT.match(grammar, i)
                if grammar.startswith(("//", "#"), i)
                else _REGEXP.match(grammar, i)
            )
        elif c == "%":
            found = _JSON_BODY.match(grammar, i)
            if found is not None:
                i = _after_json(grammar, found.end())
                continue
        elif c == "<":
            token = _SPECIAL.match(grammar, i)
            if token is not None:
                raise _refusal(grammar, i, token.group())
        i = found.end() if found is not None else i + 1


def _after_json(grammar: str, start: int) -> int:
    """The end of the JSON value at `start` (a `%json` body); llguidance reports a malformed one itself."""
    try:
        return _DECODER.raw_decode(grammar, start)[1]
    except json.JSONDecodeError:
        return start


def _refusal(grammar: str, at: int, token: str) -> SchemaError:
    line = grammar.count("\n", 0, at) + 1
    column = at - (grammar.rfind("\n", 0, at) + 1) + 1
    return SchemaError(
        f"the grammar names a token directly, {token} (line {line}, column {column}): a grammar describes "
        "the output's text, not the model's tokens, and control tokens end the request (the end-of-text "
        "token) or are dropped from the answer's text; remove it (an output ends where the start rule "
        f'ends, with no token for it), or quote it ("{token}") if you meant those characters',
        position=f"line {line}, column {column}",
    )
