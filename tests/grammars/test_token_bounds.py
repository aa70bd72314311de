"""grammars.spatial.item_token_bounds: no spelling of a complete answer takes more tokens than its bound.

One test per invariant of the "token budgets" section of grammars/spatial.py, for every spatial spec
kind (JSON points and boxes, location-token points and boxes, Qwen-VL grounding), with the SmolLM2
tokenizer and the embedded model's tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import foveal
from foveal import grammars
from foveal.families.qwen_vl.grounding import GroundingSpec
from foveal.grammars import spatial
from foveal.grammars.bitmask import allocate_bitmask, allowed_tokens
from foveal.grammars.tokenizer import tokenizer_handle

EMBEDDED = Path(foveal.__file__).parent / "embedded" / "tokenizer.json"
SMOLLM2_EOS, EMBEDDED_EOS = 2, 1
LOC_VOCAB = 49152 + 1024 + 64  # padded embedding rows, as real models have


class Vocabularies(dict):
    """name -> (tokenizer, EOS, model vocab size); a short repr for hypothesis's failure reports."""

    def __repr__(self) -> str:
        return f"Vocabularies({', '.join(self)})"


@pytest.fixture(scope="module")
def vocabularies(tok, loc_tok) -> Vocabularies:
    """For JSON and grounding answers (smollm2, embedded) and loc answers (smollm2+loc, embedded)."""
    embedded = Tokenizer.from_file(str(EMBEDDED))
    return Vocabularies(
        smollm2=(tok, SMOLLM2_EOS, None),
        embedded=(embedded, EMBEDDED_EOS, None),
        **{"smollm2+loc": (loc_tok, SMOLLM2_EOS, LOC_VOCAB)},
    )


class Speller:
    """Walks under the mask that prefer the fewest bytes per token: the longest spellings the grammar allows."""

    def __init__(self, spec: spatial.SpatialSpec, vocabulary: tuple[Tokenizer, int, int | None]) -> None:
        tokenizer, self.eos, vocab_size = vocabulary
        self.spec, self.tokenizer = spec, tokenizer
        self.automaton = grammars.compile(spec, tokenizer, eos_token_id=self.eos, vocab_size=vocab_size)
        self.bounds = spatial.item_token_bounds(spec, tokenizer, eos_token_id=self.eos, vocab_size=vocab_size)
        self.token_bytes = tokenizer_handle(tokenizer, eos_token_id=self.eos, vocab_size=vocab_size).token_bytes()
        lengths = np.full(self.automaton.vocab_size, 1 << 20)
        lengths[: len(self.token_bytes)] = [len(b) or 1 << 20 for b in self.token_bytes]  # special: last
        self.lengths = lengths

    def walk(self, rng: np.random.Generator, shortest: float, stop: float) -> list[int]:
        """Committed tokens of one complete answer, EOS included when the walk chose it."""
        matcher = self.automaton.matcher()
        bitmask = allocate_bitmask(1, self.automaton.vocab_size)
        tokens: list[int] = []
        while not matcher.is_terminated():
            matcher.fill_mask(bitmask, 0)
            allowed = allowed_tokens(bitmask, 0)
            assert len(allowed), "a dead end before the answer was complete"
            others = allowed[allowed != self.eos]
            if len(others) == 0 or (len(others) < len(allowed) and rng.random() < stop):
                token = self.eos
            elif rng.random() < shortest:
                fewest = others[self.lengths[others] == self.lengths[others].min()]
                token = int(rng.choice(fewest))
            else:
                token = int(rng.choice(others))
            matcher.commit(token)
            tokens.append(token)
        return tokens

    def text(self, tokens: list[int]) -> str:
        pieces = [
            self.token_bytes[t] or self.tokenizer.id_to_token(t).encode() for t in tokens if t != self.eos
        ]
        return b"".join(pieces).decode()

    def items(self, tokens: list[int]) -> int:
        result = spatial.parse(self.spec, self.text(tokens))
        return len(result["objects" if self.spec.kind == "boxes" else "points"])


def check_walks(speller: Speller, seed: int, walks: int = 12) -> int:
    """Invariant 1 for `walks` walks; returns the most items a walk wrote."""
    rng = np.random.default_rng(seed)
    most = 0
    for i in range(walks):
        tokens = speller.walk(rng, shortest=(0.6, 0.9, 1.0)[i % 3], stop=(0.0, 0.03, 0.1)[i % 3])
        items = speller.items(tokens)
        assert items <= speller.spec.max_objects
        assert len(tokens) <= speller.bounds.answer(items), (speller.text(tokens), items, speller.bounds)
        most = max(most, items)
    return most


labels = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=10)
separators = st.sampled_from([" ; ", " | ", ";", " ;; ", "\t;\t", " → "])
# Derandomized: the default suite (and CI) runs the same examples every time; a random run is
# `pytest --hypothesis-seed=N` with derandomize turned off (one found the 1-unit box scale dead end
# that GroundingSpec now refuses: tests/grammars/test_grounding.py).
PROPERTY = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _speller(make, vocabulary, **fields) -> Speller | None:
    """None for a spec refused before any decoding: a label the location format refuses (the separator,
    location-token text) or one holding a character the vocabulary cannot write (SmolLM2 has no token
    with the bytes 0x04 or 0xf1, so neither U+0004 nor U+40000 can be written)."""
    try:
        return Speller(make(**fields), vocabulary)
    except grammars.SchemaError as error:
        assert any(m in str(error) for m in ("separator", "location-token", "cannot write", "box scale")), error
        return None


@PROPERTY
@given(
    kind=st.sampled_from(["points", "boxes"]),
    label=labels,
    separator=separators,
    max_objects=st.integers(1, 4),
    vocabulary=st.sampled_from(["smollm2+loc", "embedded"]),
    seed=st.integers(0, 2**16),
)
def test_loc_answers_never_exceed_their_bound(vocabularies, kind, label, separator, max_objects, vocabulary, seed):
    bins = 1024 if vocabulary == "smollm2+loc" else 32  # the embedded tokenizer has 32 location tokens
    speller = _speller(
        spatial.SpatialSpec, vocabularies[vocabulary], kind=kind, encoding="loc", max_objects=max_objects,
        label=label, bins=bins, separator=separator,
    )
    if speller is not None:
        check_walks(speller, seed)


@PROPERTY
@given(
    kind=st.sampled_from(["points", "boxes"]),
    label=labels,
    width=st.integers(1, 2000),
    height=st.integers(1, 2000),
    max_objects=st.integers(1, 3),
    vocabulary=st.sampled_from(["smollm2", "embedded"]),
    seed=st.integers(0, 2**16),
)
def test_grounding_answers_never_exceed_their_bound(
    vocabularies, kind, label, width, height, max_objects, vocabulary, seed
):
    speller = _speller(
        GroundingSpec, vocabularies[vocabulary], kind=kind, max_objects=max_objects, label=label, width=width,
        height=height,
    )
    if speller is not None:
        check_walks(speller, seed, walks=6)


@pytest.mark.parametrize("vocabulary", ["smollm2", "embedded"])
@pytest.mark.parametrize("kind", ["points", "boxes"])
def test_json_answers_never_exceed_their_bound(vocabularies, kind, vocabulary):
    """No label in the JSON shape: many walks of one spec, several of them with more than one item."""
    speller = Speller(spatial.SpatialSpec(kind, max_objects=3), vocabularies[vocabulary])
    assert check_walks(speller, seed=5, walks=30) >= 2


def _longest_coordinates(spec: spatial.SpatialSpec) -> list[str]:
    """Values of one item with the longest spelling each coordinate allows (and max > min for boxes)."""
    if isinstance(spec, GroundingSpec):
        w, h = spec.width, spec.height
        return [str(v) for v in ([w - 1, h - 1, w, h] if spec.kind == "boxes" else [w, h])]
    if spec.encoding == "json":
        return ["0.125", "0.125", "0.875", "0.875"][: 2 if spec.kind == "points" else 4]
    n = spec.bins - 1
    return [spec.locations.token(k) for k in ([0, 0, n, n] if spec.kind == "boxes" else [n, n])]


def _byte_spelling(spec: spatial.SpatialSpec, speller: Speller, items: int) -> list[int]:
    """The answer of `items` items with the longest coordinates, one token per byte (loc tokens whole)."""
    byte_token = {b[0]: i for i, b in enumerate(speller.token_bytes) if len(b) == 1}
    values = iter(_longest_coordinates(spec) * items)
    ids: list[int] = []

    def write(text: str) -> None:
        ids.extend(byte_token[b] for b in text.encode())

    layout = spec.layout()
    if not items:
        write(layout.empty)
        return [*ids, speller.eos]
    write(layout.start)
    for index in range(items):
        write(layout.separator if index else "")
        for piece in layout.item:
            if isinstance(piece, str):
                write(piece)
            elif piece.special:
                ids.append(speller.tokenizer.token_to_id(next(values)))
            else:
                value = next(values)
                assert len(value) == piece.length, (value, piece)
                write(value)
    write(layout.end)
    return [*ids, speller.eos]


BYTE_SPECS = [
    spatial.points(max_objects=3),
    spatial.boxes(max_objects=3),
    spatial.points("loc", max_objects=3, label="日本語 ß", bins=32),
    spatial.boxes("loc", max_objects=3, label="|||", bins=32),
    spatial.boxes("loc", max_objects=3, bins=32),
    GroundingSpec("boxes", max_objects=3, label='a "quoted" 日本', width=1000, height=1000),
    GroundingSpec("points", max_objects=3, label="car", width=57, height=9),
]


@pytest.mark.parametrize("spec", BYTE_SPECS, ids=lambda s: f"{s.kind}-{s.encoding}-{s.label or 'none'}")
def test_the_bound_is_reached_byte_by_byte(vocabularies, spec):
    """Invariants 2 and 3: the layout's longest answer, one token per byte, is accepted by the grammar
    and takes exactly the bound, for 0 to max_objects items (the embedded vocabulary has byte tokens)."""
    speller = Speller(spec, vocabularies["embedded"])
    for items in range(spec.max_objects + 1):
        ids = _byte_spelling(spec, speller, items)
        matcher = speller.automaton.matcher()
        for token in ids:
            matcher.commit(token)
        assert matcher.is_terminated()
        assert speller.items(ids) == items
        assert len(ids) == speller.bounds.answer(items)


def test_the_canonical_spelling_undercounts(vocabularies):
    """Why the bound exists: tokenizing an answer canonically counts " ; " as 2 tokens where the grammar
    allows 3, so a budget sized that way held items the model could not finish (model.detect with
    max_tokens=60 raised IncompleteOutputError)."""
    tokenizer, eos, _ = vocabularies["embedded"]
    spec = spatial.boxes("loc", max_objects=50, label="xyzzy", bins=32)
    one, two = (len(tokenizer.encode(spec.example_answer(n), add_special_tokens=False).ids) for n in (1, 2))
    canonical_items = (60 - 1 - (one - (two - one))) // (two - one)  # the SDK's sizing from that spelling
    bounds = spatial.item_token_bounds(spec, tokenizer, eos_token_id=eos)
    assert bounds.answer(canonical_items) > 60 >= bounds.answer(bounds.items_within(60))
    assert bounds.items_within(60) < canonical_items


def test_a_vocabulary_without_byte_tokens_is_bounded_by_its_own_tokens():
    """Where a text cannot be spelled byte by byte, the bound is the longest chain of its tokens, not its bytes."""
    from tokenizers import decoders, models, pre_tokenizers

    words = ["<eos>", "<loc0000>", "<loc0001>", "\u0120", "ab", "\u0120ab", ",", "\u0120,"]  # \u0120: a space
    tokenizer = Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, []))
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tokenizer.add_special_tokens(words[:3])
    handle = tokenizer_handle(tokenizer, eos_token_id=0)
    assert spatial._spellings(handle).most_tokens(" abab") == 3  # " ", "ab", "ab": 3 tokens for 5 bytes
    spec = spatial.points("loc", label="abab", bins=2, separator=" , ")
    bounds = spatial.item_token_bounds(spec, tokenizer, eos_token_id=0)
    assert bounds.first == 2 + 3 + 1  # two location tokens, " abab" in 3 tokens, EOS
    assert bounds.further == 2 + 6  # two location tokens, " abab , " as " ", "ab", "ab", " ", ",", " "


@pytest.mark.parametrize("label", ["a\x04", "x\U00040000"])
def test_a_label_the_vocabulary_cannot_write_is_refused_at_compile(vocabularies, label):
    """SmolLM2 has no token holding the byte 0x04 or 0xf1: such an answer has no spelling, and llguidance's
    mask allowed a continuation byte there that commit then refused (a dead end mid-decode)."""
    loc_tok, eos, vocab_size = vocabularies["smollm2+loc"]
    with pytest.raises(grammars.SchemaError, match="cannot write .* no token holds its byte"):
        grammars.compile(spatial.boxes("loc", label=label), loc_tok, eos_token_id=eos, vocab_size=vocab_size)
    embedded, eos, _ = vocabularies["embedded"]  # byte tokens for every byte UTF-8 uses
    grammars.compile(spatial.boxes("loc", label=label, bins=32), embedded, eos_token_id=eos)


def test_items_within_is_the_largest_count_that_fits():
    bounds = spatial.ItemTokenBounds(empty=3, first=10, further=7)
    assert [bounds.items_within(t) for t in (9, 10, 16, 17, 23, 24)] == [0, 1, 1, 2, 2, 3]
    assert all(bounds.answer(bounds.items_within(t)) <= t for t in range(10, 200))
