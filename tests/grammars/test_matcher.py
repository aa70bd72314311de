"""The Matcher protocol the engine relies on: one test per invariant of grammars/matcher.py, plus fill_masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foveal import grammars
from foveal.grammars.bitmask import allowed_tokens, is_allowed
from foveal.grammars.conformance.feed import fresh_automaton

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def automaton(tok):
    return grammars.compile(SCHEMA, tok, eos_token_id=EOS)


def mask_of(m, vocab_size: int) -> np.ndarray:
    bm = grammars.allocate_bitmask(1, vocab_size)
    m.fill_mask(bm, 0)
    return bm[0].copy()


def test_refused_commit_names_the_token_and_changes_nothing(automaton, tok):
    m = automaton.matcher()
    for t in tok.encode('{"name": "ab", "n": ').ids:
        m.commit(t)
    before, count = mask_of(m, automaton.vocab_size), m.num_committed
    bad = tok.token_to_id("x")
    with pytest.raises(grammars.GrammarViolation, match=f"token {bad} 'x'") as err:
        m.commit(bad)
    assert err.value.token_id == bad
    assert np.array_equal(mask_of(m, automaton.vocab_size), before) and m.num_committed == count
    m.commit(tok.token_to_id("7"))  # still usable


def test_eos_is_allowed_exactly_when_the_grammar_accepts(tok):
    a = grammars.compile(grammars.Regex(r"ab+"), tok, eos_token_id=EOS)
    m = a.matcher()
    bm = grammars.allocate_bitmask(1, a.vocab_size)
    seen = []
    for t in tok.encode("abbb").ids + [EOS]:
        m.fill_mask(bm, 0)
        seen.append((is_allowed(bm, EOS), m.is_accepting()))
        m.commit(t)
    assert all(eos == acc for eos, acc in seen) and seen[0] == (False, False) and seen[-1] == (True, True)
    assert m.is_terminated()
    with pytest.raises(grammars.GrammarViolation):
        m.commit(tok.token_to_id("b"))  # nothing after EOS


def test_complete_output_terminates_and_only_eos_follows(automaton, tok):
    m = automaton.matcher()
    for t in tok.encode('{"name": "ab", "n": 7}').ids:
        assert not m.is_terminated()
        m.commit(t)
    assert m.is_terminated() and m.is_accepting()
    assert allowed_tokens(mask_of(m, automaton.vocab_size)[None]).tolist() == [EOS]
    m.commit(EOS)
    assert m.is_terminated()


def test_rollback_restores_every_earlier_state(automaton, tok):
    ids = tok.encode('{"name": "ab", "n": 7}').ids + [EOS]
    m = automaton.matcher()
    masks = [mask_of(m, automaton.vocab_size)]
    for t in ids:
        m.commit(t)
        masks.append(mask_of(m, automaton.vocab_size))
    for back in (1, 2, 5):
        m.rollback(back)
        assert np.array_equal(mask_of(m, automaton.vocab_size), masks[m.num_committed])
        for t in ids[m.num_committed : m.num_committed + back]:
            m.commit(t)
    assert m.is_terminated() and m.num_committed == len(ids)
    m.reset()
    assert np.array_equal(mask_of(m, automaton.vocab_size), masks[0])
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(1)


def test_forced_tokens_jump_forward_over_fixed_text(automaton, tok):
    m = automaton.matcher()
    assert m.forced_text() == b'{"name": "'
    forced = m.forced_tokens()  # llguidance keeps back a tail that could merge with the next token
    assert forced and '{"name": "'.startswith(tok.decode(forced))
    for t in forced:
        m.commit(t)
    for t in tok.encode('{"name": "ab'[len(tok.decode(forced)) :]).ids:
        m.commit(t)
    assert m.forced_text() == b""  # the name is free text


def test_ends_after_tells_whether_a_forced_run_completes_the_output_and_changes_nothing(automaton, tok):
    m = automaton.matcher()
    opening = m.forced_tokens()
    assert opening and not m.ends_after(opening)  # '{"name":' leaves the answer open
    for t in tok.encode('{"name": "ab", "n": 7').ids:
        m.commit(t)
    mask, count = mask_of(m, automaton.vocab_size), m.num_committed
    assert m.ends_after(tok.encode("}").ids) and not m.ends_after(tok.encode("1").ids)
    assert not m.ends_after([])  # nothing committed: the answer is not complete yet
    assert np.array_equal(mask_of(m, automaton.vocab_size), mask) and m.num_committed == count
    m.commit(tok.encode("}").ids[0])
    assert m.is_terminated()


def test_fill_masks_equals_per_row_fills_and_skips_absent_rows(automaton, tok):
    other = grammars.compile(grammars.Regex("[0-9]+"), tok, eos_token_id=EOS)
    matchers = [automaton.matcher(), None, other.matcher(), automaton.matcher()]
    for t in tok.encode('{"na').ids:
        matchers[3].commit(t)
    batch = np.full((4, automaton.tokenizer.mask_words), 7, dtype=np.int32)
    grammars.fill_masks(matchers, batch)
    assert (batch[1] == 7).all()
    for row in (0, 2, 3):
        assert np.array_equal(batch[row], mask_of(matchers[row], automaton.vocab_size))
    by_row = np.zeros_like(batch)
    grammars.fill_masks({3: matchers[3], 0: matchers[0]}, by_row)
    assert np.array_equal(by_row[[0, 3]], batch[[0, 3]]) and not by_row[1:3].any()


def test_fill_into_torch_tensors(automaton):
    m = automaton.matcher()
    t = torch.zeros((2, automaton.tokenizer.mask_words), dtype=torch.int32)
    grammars.fill_masks([None, m], t)
    single = torch.zeros_like(t)
    m.fill_mask(single, 1)
    assert torch.equal(t, single) and t[1].any() and not t[0].any()
    with pytest.raises(ValueError, match="int32"):
        m.fill_mask(torch.zeros((1, automaton.tokenizer.mask_words), dtype=torch.int64), 0)


def test_a_resource_limit_mid_output_is_an_error_not_a_finish(tok):
    """llguidance may stop on a lexer limit while decoding; the matcher must not look finished."""
    pattern = r"^$|(^(?:\S+\s+){0,99}\S+$)"  # from a real-world schema (JSONSchemaBench)
    schema = {
        "type": "object",
        "properties": {"q": {"type": "string", "maxLength": 5000, "pattern": pattern}},
        "required": ["q"],
    }
    a = grammars.compile(schema, tok, eos_token_id=EOS)
    m = a.matcher()
    bm = grammars.allocate_bitmask(1, a.vocab_size)
    for t in tok.encode('{"q": "').ids:
        m.fill_mask(bm, 0)
        m.commit(t)
    m.fill_mask(bm, 0)
    assert not m.is_terminated()
    with pytest.raises(grammars.GrammarLimitError, match="resource limit"):
        m.commit(EOS)


def verdict(automaton, ids: list[int], masks: bool) -> bool:
    m = automaton.matcher()
    bm = grammars.allocate_bitmask(1, automaton.vocab_size)
    try:
        for t in ids:
            if masks:
                m.fill_mask(bm, 0)
            m.commit(t)
    except grammars.GrammarViolation:
        return False
    return m.is_accepting()


@pytest.mark.parametrize("name", ["o21115", "o21142"])
def test_commit_verdict_does_not_depend_on_mask_fills(data_dir, tok, name):
    """Invariant 5. These files' valid instances were rejected by commit-only feeding (the shared
    lexer ran out of fuel, refilled only by mask computations) and accepted with masks."""
    import json

    from foveal.grammars.conformance.feed import serializations

    doc = json.loads((data_dir / "conformance/jsonschemabench/Github_medium" / f"{name}.json").read_text())
    texts = [(serializations(t["data"], doc["schema"])[0], t["valid"]) for t in doc["tests"]]
    # commit-only first, on a fresh automaton: nothing has warmed or refuelled its lexer
    commit_only = fresh_automaton(doc["schema"], tok)
    masked = fresh_automaton(doc["schema"], tok)
    for text, valid in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert verdict(commit_only, ids, masks=False) == verdict(masked, ids, masks=True) == valid, text


def test_a_lexer_limit_does_not_fail_later_matchers(tok):
    """Invariant 6. llguidance's lexer is shared by all matchers of an automaton and its error is
    sticky; the automaton renews its template so the limit stays with the output that hit it."""
    heavy = {"type": "string", "maxLength": 5000, "pattern": r"^$|(^(?:\S+\s+){0,99}\S+$)"}
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "q": heavy},
        "additionalProperties": False,
    }
    a = fresh_automaton(schema, tok)
    good = tok.encode('{"a": 1}').ids
    assert verdict(a, good, masks=False)
    m = a.matcher()
    with pytest.raises(grammars.GrammarLimitError, match="lexer error"):
        for t in tok.encode('{"q": "a b"}').ids:
            m.commit(t)
    assert verdict(a, good, masks=False) and verdict(a, good, masks=True)


def test_a_lexer_exhausted_behind_the_matcher_is_a_limit_not_a_violation(data_dir, tok):
    """Raw llguidance commits (no masks, so no refuelling) drain the lexer behind the wrapper's back;
    the wrapper's next commit must report llguidance's limit (GrammarLimitError), not a bad token,
    even though `try_consume_tokens` reports it as a plain refusal, and the automaton renews, so a
    matcher created afterwards accepts the valid instance."""
    import json

    from foveal.grammars.conformance.feed import serializations

    doc = json.loads((data_dir / "conformance/jsonschemabench/Github_medium/o21115.json").read_text())
    ids = tok.encode(serializations(doc["tests"][1]["data"], doc["schema"])[0]).ids
    a = fresh_automaton(doc["schema"], tok)
    m = a.matcher()
    m.fill_mask(grammars.allocate_bitmask(1, a.vocab_size), 0)  # the wrapper believes it is fuelled
    done = m._ll.try_consume_tokens(ids)
    assert done < len(ids) and not m._ll.is_error()  # llguidance itself: a silent refusal
    with pytest.raises(grammars.GrammarLimitError, match="lexer error"):
        m.commit(ids[done])
    assert verdict(a, ids, masks=False)


def test_mask_threads_default_leaves_a_core_to_the_device_thread():
    from foveal.grammars.bitmask import default_mask_threads

    assert [default_mask_threads(c) for c in (1, 2, 3, 5, 16)] == [1, 1, 2, 4, 4]


def test_mask_threads_from_environment_or_function(monkeypatch, automaton, tok):
    from foveal.grammars.bitmask import ENV_MASK_THREADS, default_mask_threads

    monkeypatch.delenv(ENV_MASK_THREADS, raising=False)
    assert grammars.mask_threads() == default_mask_threads()
    monkeypatch.setenv(ENV_MASK_THREADS, "3")
    assert grammars.mask_threads() == 3
    for bad in ("0", "two", "1.5"):
        monkeypatch.setenv(ENV_MASK_THREADS, bad)
        with pytest.raises(ValueError, match=f"{ENV_MASK_THREADS}='{bad}'.*whole number >= 1"):
            grammars.mask_threads()
    with pytest.raises(ValueError, match="set_mask_threads=0"):
        grammars.set_mask_threads(0)
    try:
        grammars.set_mask_threads(2)  # wins over the (bad) environment value
        assert grammars.mask_threads() == 2
        matchers = [automaton.matcher() for _ in range(8)]
        for i, m in enumerate(matchers):
            for t in tok.encode('{"name": "abc", "n": 1}').ids[:i]:
                m.commit(t)
        two = grammars.allocate_bitmask(8, automaton.vocab_size)
        grammars.fill_masks(matchers, two)
        grammars.set_mask_threads(1)
        one = grammars.allocate_bitmask(8, automaton.vocab_size)
        grammars.fill_masks(matchers, one)
        assert np.array_equal(one, two) and len({bytes(r) for r in one}) > 4
    finally:
        grammars.set_mask_threads(None)
    monkeypatch.setenv(ENV_MASK_THREADS, "2")
    assert grammars.mask_threads() == 2
