"""grammars.formats: string keywords made exact before llguidance compiles a schema.

One test (or group) per invariant of the module: never wider than the spec; date/time exact;
data positions untouched and the input never mutated; refusals name keyword and JSON path.
The regexes are checked with Python's `re` (they use the syntax ECMA, Rust and Python share) and
then through real automata, so llguidance is shown to read them the same way.
"""

from __future__ import annotations

import calendar
import copy
import datetime
import json
import random
import re

import jsonschema
import pytest

from foveal import grammars
from foveal.grammars import formats

EOS = 2  # SmolLM2's <|im_end|>
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


def full(regex: str, text: str) -> bool:
    return re.fullmatch(regex, text) is not None


def accepts(schema: dict, value, tok) -> bool:
    """The automaton of `schema` accepts `value` serialized in the grammar's style."""
    automaton = grammars.compile(schema, tok, eos_token_id=EOS)
    m = automaton.matcher()
    text = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    for t in tok.encode(text, add_special_tokens=False).ids:
        try:
            m.commit(t)
        except grammars.GrammarViolation:
            return False
    return m.is_accepting()


def string(fmt: str, **extra) -> dict:
    return {"type": "string", "format": fmt, **extra}


@pytest.fixture(scope="module", autouse=True)
def reference_checkers_are_active():
    """python-jsonschema silently skips formats whose checker package is missing: make sure not."""
    for fmt, bad in (("date", "2021-02-29"), ("time", "24:00:00Z"), ("hostname", "a_b")):
        assert not CHECKER.conforms(bad, fmt), f"install the dev extras (rfc3339-validator, fqdn) for {fmt!r}"


# --- invariant 2: date / time / date-time exact ----------------------------------------------


def is_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return len(text) == 10


def test_date_is_the_gregorian_calendar():
    years = (1, 4, 99, 100, 400, 1900, 1996, 2000, 2020, 2021, 2100, 2400, 9999)
    texts = [f"{y:04d}-{m:02d}-{d:02d}" for y in years for m in range(14) for d in range(33)]
    texts += [f"{y:04d}-02-29" for y in range(1, 10000)]  # every leap-day candidate
    for text in texts:
        assert full(formats.DATE, text) == is_date(text) == CHECKER.conforms(text, "date"), text
    assert sum(full(formats.DATE, f"{y:04d}-02-29") for y in range(1, 10000)) == sum(
        calendar.isleap(y) for y in range(1, 10000)
    )
    for text in ("0000-01-01", "2021-1-01", "2021-01-01T", "20210101", "٢٠٢١-01-01"):
        assert not full(formats.DATE, text), text


def utc_minute(local: int, offset: int) -> int:
    """Minute of the UTC day of local time `local` (minutes) written with offset `offset` (minutes)."""
    return (local - offset) % (24 * 60)


def time_text(local: int, offset: int | None, second: str = "60", fraction: str = "") -> str:
    zone = (
        "Z"
        if offset is None
        else f"{'+' if offset >= 0 else '-'}{abs(offset) // 60:02d}:{abs(offset) % 60:02d}"
    )
    return f"{local // 60:02d}:{local % 60:02d}:{second}{fraction}{zone}"


LAST_MINUTE = 23 * 60 + 59
OFFSETS = range(-(24 * 60 - 1), 24 * 60)


def covered(offset: int) -> bool:
    """Offsets whose leap seconds the grammar emits (documented: the minutes of zones in use)."""
    return abs(offset) % 60 in formats.LEAP_OFFSET_MINUTES


def test_leap_second_only_at_2359_utc_for_every_offset():
    for offset in OFFSETS:
        good = (LAST_MINUTE + offset) % (24 * 60)
        assert full(formats.TIME, time_text(good, offset)) == covered(offset), time_text(good, offset)
        for wrong in (good - 1, good + 1, good - 60, good + 60, good + 1 - 60):
            text = time_text(wrong % (24 * 60), offset, fraction=".5")
            assert not full(formats.TIME, text), text
    assert full(formats.TIME, "23:59:60Z") and full(formats.TIME, "23:59:60.25z")
    assert full(formats.TIME, "23:59:60-00:00") and not full(formats.TIME, "23:58:60Z")


def test_leap_seconds_in_every_zone_in_use():
    for zone in ("+05:45", "+05:30", "-03:30", "+12:45", "+08:45", "+14:00", "-12:00", "-09:30"):
        offset = (1 if zone[0] == "+" else -1) * (int(zone[1:3]) * 60 + int(zone[4:]))
        local = (LAST_MINUTE + offset) % (24 * 60)
        assert full(formats.TIME, time_text(local, offset)), zone


def test_leap_second_random_pairs_match_the_utc_rule():
    rng = random.Random(0)
    for _ in range(20000):
        local, offset = rng.randrange(24 * 60), rng.choice(OFFSETS)
        text = time_text(local, offset)
        expected = utc_minute(local, offset) == LAST_MINUTE and covered(offset)
        assert full(formats.TIME, text) == expected, text


def test_ordinary_times_agree_with_rfc3339():
    rng = random.Random(1)
    pieces = ["00", "09", "23", "24", "59", "60", "7", "5a"]
    zones = ["Z", "z", "+00:00", "-23:59", "+24:00", "+05:60", "", "+0530", "-1:00"]
    for _ in range(5000):
        h, m, s = rng.choice(pieces), rng.choice(pieces), rng.choice(pieces[:5])
        text = f"{h}:{m}:{s}{rng.choice(['', '.1', '.123456', '.'])}{rng.choice(zones)}"
        assert full(formats.TIME, text) == CHECKER.conforms(text, "time"), text
        stamp = f"2024-02-29{rng.choice('Tt ')}{text}"
        assert full(formats.DATE_TIME, stamp) == CHECKER.conforms(stamp, "date-time"), stamp
    assert not full(formats.DATE_TIME, "2023-02-29T12:00:00Z")


def test_automata_read_the_regexes_as_python_does(tok):
    cases = {
        "date": {"2024-02-29": True, "2100-02-29": False, "2000-02-29": True, "2021-04-31": False},
        "time": {"23:59:60Z": True, "00:59:60+01:00": True, "22:59:60-01:00": True, "23:59:60+01:00": False},
        "date-time": {
            "1998-12-31T23:59:60.5Z": True,
            "1998-12-31T15:59:60-08:00": True,
            "1998-12-31T23:58:60Z": False,
        },
    }
    for fmt, values in cases.items():
        for value, valid in values.items():
            assert accepts(string(fmt), value, tok) == valid, (fmt, value)


# --- invariant 1: hostname never wider than the spec -----------------------------------------


def random_hostname(rng: random.Random) -> str:
    """Mostly well-formed labels (so both sides of the rule are reached), some with flaws."""

    def label() -> str:
        size = rng.choice([1, 2, 3, 4, 5, 8, 62, 63, 64])
        chars = [rng.choice("ab9X-") for _ in range(size)]
        if rng.random() < 0.2 and size >= 4:
            chars[2:4] = ["-", "-"]
        if rng.random() < 0.05:
            chars[rng.randrange(size)] = rng.choice("_.é ")
        if rng.random() < 0.8:  # usually alphanumeric at both ends
            chars[0], chars[-1] = rng.choice("ab9X"), rng.choice("ab9X")
        return "".join(chars)

    text = ".".join(label() for _ in range(rng.randint(1, 5)))
    return text + "." if rng.random() < 0.05 else text


def test_hostname_is_rfc1123_without_a_labels_or_trailing_dot():
    """Accepted exactly when python-jsonschema's checker (fqdn) accepts, minus the documented narrowing."""
    rng = random.Random(2)
    verdicts = []
    for _ in range(5000):
        text = random_hostname(rng)
        ours = len(text) <= formats.HOSTNAME_MAX_LENGTH and full(formats.HOSTNAME, text)
        narrowed = text.endswith(".") or any(label[2:4] == "--" for label in text.split("."))
        assert ours == (CHECKER.conforms(text, "hostname") and not narrowed), text
        verdicts.append(ours)
    assert 0.2 < sum(verdicts) / len(verdicts) < 0.8  # both sides of the rule are exercised


def test_hostname_limits(tok):
    assert accepts(string("hostname"), "a" * 63 + ".com", tok)
    assert not accepts(string("hostname"), "a" * 64 + ".com", tok)
    longest = ".".join(["a" * 63] * 3 + ["a" * 61])  # 253 characters
    assert accepts(string("hostname"), longest, tok)
    assert not accepts(string("hostname"), longest + "a", tok)
    assert accepts(string("hostname"), "a--b.com", tok)
    assert not accepts(string("hostname"), "xn--4dbc5h", tok)  # documented: no A-labels
    assert not accepts(string("hostname"), "example.", tok)
    assert not accepts(string("hostname", maxLength=5), "abcdef", tok)  # a smaller maxLength stays


# --- ECMA-262 classes in patterns -------------------------------------------------------------

WS = formats.ECMA_WHITESPACE


@pytest.mark.parametrize(
    ("pattern", "translated"),
    [
        (r"^\s$", f"^[{WS}]$"),
        (r"\S+", f"[^{WS}]+"),
        (r"[a\s]", f"[a{WS}]"),
        (r"[^\S]", f"[^[^{WS}]]"),
        (r"\\s", r"\\s"),  # an escaped backslash, then a letter s
        (r"a.b", f"a{formats.ECMA_DOT}b"),
        (r"[.]\.", r"[.]\."),
        (r"[].]x", r"[].]x"),  # `]` first in a class is a member
        (r"[^].]x", r"[^].]x"),
        (r"\d\p{L}", r"\d\p{L}"),
    ],
)
def test_ecma_pattern_translation(pattern, translated):
    assert formats.ecma_pattern(pattern) == translated


def test_patterns_read_as_ecma(tok):
    non_space = {"type": "string", "pattern": r"^\S$"}
    assert not accepts(non_space, "\ufeff", tok)  # ECMA whitespace
    assert accepts(non_space, "\x85", tok)  # not ECMA whitespace (Rust's \s has it)
    assert accepts({"type": "string", "pattern": r"^\s$"}, "\ufeff", tok)
    dot = {"type": "string", "pattern": "^.$"}
    for terminator in "\r\u2028\u2029\n":
        assert not accepts(dot, terminator, tok), repr(terminator)
    assert accepts(dot, "\x85", tok)
    keyed = {
        "type": "object",
        "patternProperties": {r"^\S+$": {"type": "integer"}},
        "additionalProperties": False,
    }
    assert accepts(keyed, {"ab": 1}, tok) and not accepts(keyed, {"a\ufeff": 1}, tok)


# --- invariant 3: data positions untouched, input never mutated ------------------------------


def test_data_positions_are_not_rewritten_and_input_is_not_mutated():
    schema = {
        "type": "object",
        "properties": {
            "format": {"type": "string", "format": "date"},
            "pattern": {"const": {"format": "date", "pattern": "a.b"}},
        },
        "enum": [{"format": "date"}],
        "default": {"pattern": r"\s"},
        "examples": [{"format": "time"}],
    }
    before = copy.deepcopy(schema)
    out = formats.exact_string_constraints(schema)
    assert schema == before
    assert out["properties"]["format"] == {"$ref": "#/$defs/foveal-format-date"}
    assert out["$defs"]["foveal-format-date"] == {"type": "string", "pattern": f"^{formats.DATE}$"}
    assert out["properties"]["pattern"] == before["properties"]["pattern"]
    for key in ("enum", "default", "examples"):
        assert out[key] == before[key]


def test_a_format_joins_an_existing_pattern(tok):
    schema = {"type": "string", "format": "date", "pattern": "^2024-"}
    out = formats.exact_string_constraints(schema)
    assert out["pattern"] == "^2024-" and out["allOf"] == [{"pattern": f"^{formats.DATE}$"}]
    assert accepts(schema, "2024-02-29", tok)
    assert not accepts(schema, "2023-02-28", tok) and not accepts(schema, "2024-02-30", tok)


def test_plain_format_nodes_share_one_definition(tok):
    stamp = {"type": "string", "format": "date-time", "description": "when"}
    schema = {"type": "object", "properties": {"a": stamp, "b": stamp}, "$defs": {"n": {"type": "integer"}}}
    out = formats.exact_string_constraints(schema)
    assert out["properties"] == {"a": {"$ref": "#/$defs/foveal-format-date-time"}} | {
        "b": {"$ref": "#/$defs/foveal-format-date-time"}
    }
    assert set(out["$defs"]) == {"n", "foveal-format-date-time"}
    good = {"a": "2024-02-29T23:59:60Z", "b": "2024-01-01t00:00:00.5+01:00"}
    assert accepts(schema, good, tok)
    assert not accepts(schema, {**good, "b": "2023-02-29T00:00:00Z"}, tok)


def test_formats_stay_inline_where_a_ref_would_change_meaning(tok):
    constrained = {"type": "string", "format": "date", "maxLength": 10}
    assert (
        "$ref" not in formats.exact_string_constraints({"properties": {"d": constrained}})["properties"]["d"]
    )
    assert "$ref" not in formats.exact_string_constraints({"type": "string", "format": "date"})
    nullable = {"oneOf": [string("date"), {"type": "null"}]}  # a $ref would hide the branch's type
    assert "$ref" not in formats.exact_string_constraints(nullable)["oneOf"][0]
    assert accepts(nullable, None, tok) and not accepts(nullable, "2023-02-29", tok)
    nested_id = {
        "type": "object",
        "properties": {"x": {"$id": "http://example.com/x", "properties": {"d": string("date")}}},
    }
    out = formats.exact_string_constraints(nested_id)
    assert "$defs" not in out and out["properties"]["x"]["properties"]["d"]["pattern"] == f"^{formats.DATE}$"
    assert accepts(nested_id, {"x": {"d": "2024-02-29"}}, tok)
    assert not accepts(nested_id, {"x": {"d": "2023-02-29"}}, tok)


# --- invariant 4: refusals name keyword and path ----------------------------------------------


@pytest.mark.parametrize("fmt", sorted(formats.REFUSED_FORMATS))
def test_refused_formats_name_keyword_and_path(fmt, tok):
    schema = {"type": "object", "properties": {"host": {"type": "string", "format": fmt}}}
    with pytest.raises(grammars.SchemaError) as err:
        grammars.compile(schema, tok, eos_token_id=EOS)
    assert err.value.keyword == "format" and err.value.path == "#/properties/host"
    assert fmt in str(err.value) and "remove" in str(err.value)


DRAFT7 = "http://json-schema.org/draft-07/schema#"


def test_draft7_content_encoding_base64_is_enforced(tok):
    schema = {"$schema": DRAFT7, "type": "string", "contentEncoding": "base64"}
    assert accepts(schema, "eyJmb28iOiAiYmFyIn0K", tok)
    assert accepts(schema, "YQ==", tok) and accepts(schema, "", tok)
    for bad in ("eyJmb28iOi%iYmFyIn0K", "YQ=", "YQ==YQ==", "abc"):
        assert not accepts(schema, bad, tok), bad


def test_draft7_content_media_type_and_other_encodings_are_refused(tok):
    for keyword, value in (("contentMediaType", "application/json"), ("contentEncoding", "base32")):
        schema = {"$schema": DRAFT7, "properties": {"doc": {"type": "string", keyword: value}}}
        with pytest.raises(grammars.SchemaError) as err:
            grammars.compile(schema, tok, eos_token_id=EOS)
        assert err.value.keyword == keyword and err.value.path == "#/properties/doc"


def test_content_keywords_are_annotations_outside_draft7(tok):
    schema = {"type": "string", "contentEncoding": "base64", "contentMediaType": "application/json"}
    assert accepts(schema, "not base64 %", tok)
    assert accepts({"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}, "{", tok)


def test_every_exact_format_compiles(tok):
    """Each format compiles to a JSON automaton that accepts a valid value and refuses an invalid one."""
    examples = {
        "date": ("2024-02-29", "2023-02-29"),
        "time": ("12:00:00Z", "24:00:00Z"),
        "date-time": ("2024-02-29T12:00:00Z", "2024-02-29 12:00:00Z"),
        "hostname": ("example.com", "a_b.com"),
    }
    assert set(examples) == set(formats.EXACT_FORMATS)
    for fmt, (good, bad) in examples.items():
        automaton = grammars.compile(string(fmt), tok, eos_token_id=EOS)
        assert isinstance(automaton, grammars.Automaton) and automaton.kind == "json_schema"
        assert accepts(string(fmt), good, tok), (fmt, good)
        assert not accepts(string(fmt), bad, tok), (fmt, bad)
