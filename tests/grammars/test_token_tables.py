"""Token tables kept between processes (grammars/token_tables.py): one test per invariant.

Invariant 1: a table read from the cache is the one llguidance builds, and the handle made from it
gives the same masks; invariant 2: a damaged file is reported, not used, and written again;
invariant 3: a cache that cannot be written costs only the time, and `FOVEAL_TOKENIZER_CACHE=0`
reads and writes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from foveal import grammars
from foveal.grammars import compiler, token_tables, tokenizer

EOS = 2
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The token table cache on, in a folder of its own (tests/conftest.py keeps it off)."""
    monkeypatch.setenv(token_tables.ENV_ROOT, str(tmp_path))
    monkeypatch.setenv(token_tables.ENV_OFF, "1")
    return tmp_path / "tokenizers"


@pytest.fixture
def json_reads(monkeypatch):
    """How many LLTokenizers were built from a tokenizer's JSON (what a cached table saves)."""
    calls = []
    built = token_tables.llguidance.LLTokenizer

    def counting(source, *args, **kwargs):
        calls.append(isinstance(source, str))
        return built(source, *args, **kwargs)

    monkeypatch.setattr(token_tables.llguidance, "LLTokenizer", counting)
    return calls


def fresh_handle(tok, vocab_size=None) -> tokenizer.TokenizerHandle:
    """A handle as a new process builds it: nothing in the in-memory caches."""
    for lru in (tokenizer._BY_IDENTITY, tokenizer._BY_OBJECT, compiler.AUTOMATA):
        lru.clear()
    return tokenizer.tokenizer_handle(tok, eos_token_id=EOS, vocab_size=vocab_size)


def masks(tok, text: str) -> list[np.ndarray]:
    """The masks of SCHEMA's automaton along `text`'s tokens, compiled afresh."""
    compiler.AUTOMATA.clear()
    automaton = grammars.compile(SCHEMA, tok, eos_token_id=EOS)
    matcher, out = automaton.matcher(), []
    bitmask = grammars.allocate_bitmask(1, automaton.vocab_size)
    for token in tok.encode(text).ids:
        matcher.fill_mask(bitmask, 0)
        out.append(bitmask[0].copy())
        matcher.commit(token)
    return out


def test_a_later_handle_reads_the_table_an_earlier_wrote_and_masks_agree(tok, cache, json_reads):
    first = fresh_handle(tok)
    assert json_reads.count(True) == 1 and len(list(cache.glob("*.npz"))) == 1
    first_masks = masks(tok, '{"n": 42}')
    second = fresh_handle(tok)
    assert json_reads.count(True) == 1  # read from the file, not from the JSON
    assert second.key == first.key and second.token_bytes() == first.token_bytes()
    assert all(np.array_equal(a, b) for a, b in zip(masks(tok, '{"n": 42}'), first_masks, strict=True))
    # another vocab size is another table
    fresh_handle(tok, vocab_size=49280)
    assert json_reads.count(True) == 2 and len(list(cache.glob("*.npz"))) == 2


def test_the_table_is_what_llguidance_reads_from_the_json(tok, cache):
    text = tok.to_str()
    path = token_tables.table_path("d" * 32, EOS, 49152)
    built = token_tables.token_table(text, "d" * 32, EOS, 49152)
    assert path.exists()
    reference = token_tables.llguidance.LLTokenizer(text, n_vocab=49152, eos_token=EOS)
    assert built[0] == [reference.decode_bytes([i]) for i in range(49152)]
    assert built[1] == [i for i in range(49152) if reference.is_special_token(i)] and EOS in built[1]
    assert token_tables.token_table(text, "d" * 32, EOS, 49152) == built  # and so is the one read back


@pytest.mark.parametrize(
    "damage",
    ["truncated", "not a zip", "a token too many bytes", "a token too many", "a special id out of range"],
)
def test_a_damaged_table_is_reported_not_used_and_written_again(tok, cache, json_reads, damage):
    reference = fresh_handle(tok).token_bytes()
    (path,) = cache.glob("*.npz")
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:5000])
    elif damage == "not a zip":
        path.write_bytes(b"\x00" * 100)
    else:
        with np.load(path) as arrays:
            parts = dict(arrays)
        if damage == "a token too many bytes":
            parts["lengths"][7] += 1
        elif damage == "a token too many":
            parts["data"] = np.append(parts["data"], np.uint8(65))
            parts["lengths"] = np.append(parts["lengths"], 1)
        else:
            parts["special"][0] = 10**6
        with open(path, "wb") as out:
            np.savez(out, **parts)
    with pytest.warns(UserWarning, match="token table .* is damaged"):
        again = fresh_handle(tok)
    assert again.token_bytes() == reference and json_reads.count(True) == 2
    fresh_handle(tok)  # the file written again is read without a word
    assert json_reads.count(True) == 2


def test_a_write_removes_the_tables_of_other_llguidance_versions(tok, cache, json_reads):
    cache.mkdir(parents=True)
    other = cache / f"{'0' * 32}.V49152.eos2.llguidance-0.0.1.f{token_tables.FORMAT}.npz"
    other.write_bytes(b"a table of an older llguidance")
    unrelated = cache / "notes.txt"
    unrelated.write_text("kept")
    fresh_handle(tok)
    assert not other.exists() and unrelated.exists() and len(list(cache.glob("*.npz"))) == 1


def test_an_unwritable_cache_costs_only_the_time(tok, tmp_path, monkeypatch, json_reads):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(token_tables.ENV_ROOT, str(blocker))
    monkeypatch.setenv(token_tables.ENV_OFF, "1")
    with pytest.warns(UserWarning, match="could not write its token table"):
        handle = fresh_handle(tok)
    assert masks(tok, '{"n": 5}') and handle.token_bytes()[EOS] == b""


def test_off_reads_and_writes_nothing(tok, tmp_path, monkeypatch, json_reads):
    monkeypatch.setenv(token_tables.ENV_ROOT, str(tmp_path))
    monkeypatch.setenv(token_tables.ENV_OFF, "0")
    fresh_handle(tok)
    fresh_handle(tok)
    assert json_reads.count(True) == 2 and not any(tmp_path.iterdir())
