"""grammars.spatial: shapes, limits and geometric validity; one test per invariant of grammars/bounded.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

from foveal import grammars
from foveal.grammars import spatial
from foveal.grammars.bounded import greater_than
from foveal.grammars.locations import LocationFormat, LocationParseError
from foveal.grammars.walk import random_walk

EOS = 2
V_LOC = 49152 + 1024 + 64  # padded embedding rows, as real models have
JSON_NUMBER = re.compile(r"0(\.\d{1,3})?|1(\.0{1,3})?")
LOC_BOX = re.compile(r"(<loc\d{4}>){4} red circle")
LOC_POINT = re.compile(r"(<loc\d{4}>){2} red circle")


def compile_spec(spec, tok, loc_tok):
    if spec.encoding == "loc":
        return grammars.compile(spec, loc_tok, eos_token_id=EOS, vocab_size=V_LOC), loc_tok
    return grammars.compile(spec, tok, eos_token_id=EOS), tok


def check_output(spec, text: str) -> dict:
    """Parse an output and assert everything the spec promises about it."""
    result = spatial.parse(spec, text)
    items = result["points" if spec.kind == "points" else "objects"]
    assert len(items) <= spec.max_objects
    if spec.encoding == "json":
        numbers = re.findall(r": ([0-9.]+)", text)
        assert all(JSON_NUMBER.fullmatch(n) for n in numbers), text
        keys = ["x", "y"] if spec.kind == "points" else ["x_min", "y_min", "x_max", "y_max"]
        assert all(list(item) == keys for item in items), text
    else:
        pattern = LOC_POINT if spec.kind == "points" else LOC_BOX
        assert text == "" or all(pattern.fullmatch(item) for item in text.split(" ; ")), text
    for item in items:
        assert all(0.0 <= v <= 1.0 for v in item.values())
        if spec.kind == "boxes":
            assert item["x_min"] < item["x_max"] and item["y_min"] < item["y_max"], text
    return result


SPECS = [
    spatial.points(max_objects=3),
    spatial.boxes(max_objects=3),
    spatial.points("loc", max_objects=3, label="red circle"),
    spatial.boxes("loc", max_objects=3, label="red circle"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.encoding}")
def test_random_walks_emit_only_valid_shapes(spec, tok, loc_tok):
    """Invariant 1: every walk under the mask ends in a valid output, never at a dead end."""
    automaton, t = compile_spec(spec, tok, loc_tok)
    rng = np.random.default_rng(7)
    counts = []
    for i in range(40):
        walk = random_walk(automaton, rng, max_tokens=400, pull=0.001 * (i % 2))
        assert walk.terminated and not walk.empty_mask
        result = check_output(spec, t.decode(walk.tokens, skip_special_tokens=False))
        counts.append(len(next(iter(result.values()))))
    assert max(counts) == spec.max_objects and min(counts) < spec.max_objects  # limit reached, and not always


def test_the_property_test_has_teeth(loc_tok):
    """Walking under llguidance's shape mask alone (no bounds) does emit impossible boxes."""
    spec = spatial.boxes("loc", max_objects=3, label="red circle")
    automaton = grammars.compile(spec, loc_tok, eos_token_id=EOS, vocab_size=V_LOC)
    rng = np.random.default_rng(0)
    invalid = 0
    for _ in range(10):
        m = automaton.matcher()
        bm = grammars.allocate_bitmask(1, automaton.vocab_size)
        tokens = []
        while not m.is_terminated() and len(tokens) < 100:
            m._ll.unsafe_compute_mask_ptr(bm.ctypes.data, bm.nbytes)  # shape only
            token = int(rng.choice(grammars.bitmask.allowed_tokens(bm)))
            m._ll.consume_token(token)
            tokens.append(token)
        boxes = spatial.parse(
            spec, loc_tok.decode([x for x in tokens if x != EOS], skip_special_tokens=False)
        )
        invalid += sum(b["x_min"] >= b["x_max"] or b["y_min"] >= b["y_max"] for b in boxes["objects"])
    assert invalid > 0


def test_json_bound_refuses_a_smaller_max_and_keeps_state(tok):
    """Invariant 2 (JSON): x_max digits that cannot exceed x_min are refused; the matcher is unchanged."""
    a = grammars.compile(spatial.boxes(), tok, eos_token_id=EOS)
    m = a.matcher()
    for t in tok.encode('{"objects": [{"x_min": 0.5, "y_min": 0.25, "x_max": 0.').ids:
        m.commit(t)
    count = m.num_committed
    with pytest.raises(grammars.GrammarViolation, match="max must exceed its min"):
        m.commit(tok.token_to_id("4"))
    assert m.num_committed == count
    m.commit(tok.token_to_id("5"))  # 0.5x can still exceed 0.5 ...
    with pytest.raises(grammars.GrammarViolation):
        m.commit(tok.token_to_id(","))  # ... but 0.5 itself cannot
    for t in tok.encode('01, "y_max": 0.2').ids:
        m.commit(t)
    with pytest.raises(grammars.GrammarViolation):
        m.commit(tok.token_to_id("}"))  # y_max 0.2 <= y_min 0.25
    for t in tok.encode("6}]}").ids:
        m.commit(t)
    assert m.is_terminated()


def test_loc_bound_refuses_a_smaller_max(loc_tok):
    """Invariant 2 (loc): y_max must exceed y_min, x_max must exceed x_min (bins)."""
    a = grammars.compile(spatial.boxes("loc", label="car"), loc_tok, eos_token_id=EOS, vocab_size=V_LOC)
    loc = [loc_tok.token_to_id(spatial.loc_token(k)) for k in range(1024)]
    m = a.matcher()
    m.commit(loc[10])  # y_min
    m.commit(loc[20])  # x_min
    with pytest.raises(grammars.GrammarViolation, match="min bin 10"):
        m.commit(loc[10])
    m.commit(loc[11])
    with pytest.raises(grammars.GrammarViolation, match="min bin 20"):
        m.commit(loc[5])
    bm = grammars.allocate_bitmask(1, a.vocab_size)
    m.fill_mask(bm, 0)
    assert grammars.bitmask.allowed_tokens(bm).tolist() == loc[21:]


def test_min_fields_leave_room_for_a_max(tok, loc_tok):
    a = grammars.compile(spatial.boxes(), tok, eos_token_id=EOS)
    m = a.matcher()
    for t in tok.encode('{"objects": [{"x_min": ').ids:
        m.commit(t)
    with pytest.raises(grammars.GrammarViolation):
        m.commit(tok.token_to_id("1"))
    a = grammars.compile(spatial.boxes("loc", label="car"), loc_tok, eos_token_id=EOS, vocab_size=V_LOC)
    with pytest.raises(grammars.GrammarViolation):
        a.matcher().commit(loc_tok.token_to_id("<loc1023>"))


@pytest.mark.parametrize("spec", [SPECS[1], SPECS[3]], ids=["json", "loc"])
def test_rollback_restores_masks(spec, tok, loc_tok):
    """Invariant 3: after rollback(n) the masks are those recorded at that point of the walk."""
    automaton, _ = compile_spec(spec, tok, loc_tok)
    walk = random_walk(automaton, np.random.default_rng(3), max_tokens=400)
    m = automaton.matcher()
    bm = grammars.allocate_bitmask(1, automaton.vocab_size)
    masks = []
    for t in walk.tokens:
        m.fill_mask(bm, 0)
        masks.append(bm[0].copy())
        m.commit(t)
    for n in (1, 3, 7, 12, len(walk.tokens) // 2):
        m.rollback(n)
        m.fill_mask(bm, 0)
        assert np.array_equal(bm[0], masks[m.num_committed])
        for t in walk.tokens[m.num_committed : m.num_committed + n]:
            m.commit(t)
    assert m.is_accepting()  # the walk's tokens (EOS excluded) form a complete output again


def test_batched_fill_applies_the_bounds(tok, loc_tok):
    for spec in (SPECS[1], SPECS[3]):
        automaton, _ = compile_spec(spec, tok, loc_tok)
        walks = [random_walk(automaton, np.random.default_rng(s), max_tokens=400) for s in range(3)]
        matchers = []
        for w in walks:
            m = automaton.matcher()
            for t in w.tokens[: len(w.tokens) // 2 + 3]:
                m.commit(t)
            matchers.append(m)
        batch = grammars.allocate_bitmask(3, automaton.vocab_size)
        grammars.fill_masks(matchers, batch)
        for row, m in enumerate(matchers):
            single = grammars.allocate_bitmask(1, automaton.vocab_size)
            m.fill_mask(single, 0)
            assert np.array_equal(batch[row], single[0])


def test_greater_than_accepts_exactly_the_larger_numbers():
    """Invariant 4, exhaustively over every bound and every 3-decimal spelling in [0, 1]."""
    spellings = ["0", "1", "1.0", "1.00", "1.000"] + [f"0.{d}" for d in range(10)]
    spellings += [f"0.{d:02d}" for d in range(100)] + [f"0.{d:03d}" for d in range(1000)]
    for k in range(1000):
        regex = re.compile(greater_than(k))
        wrong = [s for s in spellings if bool(regex.fullmatch(s)) != (round(float(s) * 1000) > k)]
        assert not wrong, (k, wrong[:5])


def test_loc_encoding_round_trips_and_needs_the_tokens(tok):
    fmt = LocationFormat(1024)
    assert fmt.encode(0.5) == 512 and fmt.decode(1023) == 1.0 and fmt.encode(1.7) == 1023
    small = LocationFormat(32)
    assert all(small.encode(small.decode(k)) == k for k in range(32))
    with pytest.raises(grammars.SchemaError, match="no <loc0000> token"):
        grammars.compile(spatial.boxes("loc", label="car"), tok, eos_token_id=EOS)


def test_zero_items_end_at_once(loc_tok):
    a = grammars.compile(
        spatial.points("loc", label="dog", bins=64), loc_tok, eos_token_id=EOS, vocab_size=V_LOC
    )
    m = a.matcher()
    assert m.is_accepting()
    m.commit(EOS)
    assert m.is_terminated()
    assert spatial.parse(spatial.points("loc", label="dog", bins=64), "") == {"points": []}


def test_bad_spatial_specs_are_refused():
    with pytest.raises(grammars.SchemaError, match="max_objects"):
        spatial.boxes(max_objects=0)
    with pytest.raises(grammars.SchemaError, match="label"):
        spatial.points("json", label="car")


# ---- the location format: one owner (grammars.locations), read back exactly ----------------------------------


def test_the_grammar_writes_items_with_the_formats_separator(loc_tok):
    """A separator other than " ; " (a foveal.json may set one) is what the automaton emits and parses."""
    spec = spatial.boxes("loc", max_objects=3, label="red circle", separator=" | ")
    automaton = grammars.compile(spec, loc_tok, eos_token_id=EOS, vocab_size=V_LOC)
    texts = []
    for seed in range(20):
        walk = random_walk(automaton, np.random.default_rng(seed), max_tokens=400)
        texts.append(loc_tok.decode(walk.tokens, skip_special_tokens=False))
    several = [t for t in texts if t.count("<loc") > 4]
    assert several and all(" | " in t and ";" not in t for t in several)
    for text in texts:
        boxes = spatial.parse(spec, text)["objects"]
        assert len(boxes) == text.count("<loc") // 4
        assert text == spec.locations.join([spec.locations.box_item(_box(b), "red circle") for b in boxes])


def _box(b: dict) -> tuple[float, float, float, float]:
    return b["x_min"], b["y_min"], b["x_max"], b["y_max"]


@pytest.mark.parametrize(
    "text",
    [
        "<loc0001><loc0002><loc0003> red circle",  # a coordinate short
        "<loc0001><loc0002><loc0003><loc0004> red",  # label cut
        "<loc0001><loc0002><loc0003><loc0004> red circle ; ",  # separator without an item
        "<loc0001><loc0002><loc0003><loc0004> red circle;<loc0001><loc0002><loc0003><loc0004> red circle",
        "<loc0001><loc0002><loc0003><loc1024> red circle",  # no such bin
    ],
)
def test_parse_refuses_what_the_grammar_cannot_make(text):
    with pytest.raises(LocationParseError, match="expected"):
        spatial.parse(spatial.boxes("loc", label="red circle"), text)


@pytest.mark.parametrize(
    "label, message",
    [("circle ; square", "separator"), ("<loc0005> circle", "location-token"), ("a <loc", "location-token")],
)
def test_labels_that_would_make_parsing_ambiguous_are_refused(label, message):
    with pytest.raises(grammars.SchemaError, match=message):
        spatial.boxes("loc", label=label)
    assert spatial.boxes("loc", label="circle | square").label == "circle | square"  # not this separator


@pytest.mark.parametrize("separator", ["", "  ", "<loc0001>", "a\nb"])
def test_unusable_separators_are_refused(separator):
    with pytest.raises(grammars.SchemaError, match="separator"):
        spatial.points("loc", label="dog", separator=separator)


def test_a_label_with_characters_lark_refuses_raw_is_written_verbatim(loc_tok):
    """A DEL in the object phrase made the Lark literal a lexer error ("invalid grammar"); it is escaped now."""
    spec = spatial.points("loc", max_objects=1, label="a\x7fb ß")
    automaton = grammars.compile(spec, loc_tok, eos_token_id=EOS, vocab_size=V_LOC)
    walk = random_walk(automaton, np.random.default_rng(0), max_tokens=100, pull=0.0)
    text = loc_tok.decode(walk.tokens, skip_special_tokens=False)
    assert walk.terminated and text.endswith(" a\x7fb ß") and len(spatial.parse(spec, text)["points"]) == 1
