"""`Matcher.forced_tokens()`, what jump-forward decoding (engine/pipeline.py) appends without sampling:
along random walks under the mask, every forced run is allowed token by token (the first by the
current mask, each next one by the mask after committing the ones before), composite matchers
included, and committing it never raises."""

from __future__ import annotations

import numpy as np
import pytest

from foveal import grammars
from foveal.grammars.bitmask import allocate_bitmask, allowed_tokens
from tests.grammars.test_spatial import SPECS, compile_spec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Berlin"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def check_forced_along_walks(automaton, seed: int, walks: int = 6, max_tokens: int = 120) -> int:
    """Walk under the mask; at every state commit the forced run and roll it back. Returns the forced tokens seen."""
    rng = np.random.default_rng(seed)
    bitmask = allocate_bitmask(1, automaton.vocab_size)
    seen = 0
    for _ in range(walks):
        matcher = automaton.matcher()
        for _ in range(max_tokens):
            if matcher.is_terminated():
                break
            forced = matcher.forced_tokens()
            for token in forced:
                matcher.fill_mask(bitmask, 0)
                assert token in set(allowed_tokens(bitmask, 0).tolist()), (forced, token)
                matcher.commit(token)
            matcher.rollback(len(forced))
            seen += len(forced)
            matcher.fill_mask(bitmask, 0)
            allowed = allowed_tokens(bitmask, 0)
            assert len(allowed)
            matcher.commit(int(rng.choice(allowed)))
    return seen


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.encoding}")
def test_forced_runs_of_spatial_matchers_are_allowed_token_by_token(spec, tok, loc_tok):
    automaton, _ = compile_spec(spec, tok, loc_tok)
    assert check_forced_along_walks(automaton, seed=1) > 0


def test_forced_runs_of_a_json_schema_are_allowed_and_cover_its_keys(tok):
    automaton = grammars.compile(SCHEMA, tok, eos_token_id=2)
    matcher = automaton.matcher()
    assert tok.decode(matcher.forced_tokens()) == '{"name":'  # the object's opening is forced
    assert check_forced_along_walks(automaton, seed=2) > 0

