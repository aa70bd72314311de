"""The compile budget (grammars/limits.py), native error text (grammars/errors.py) and the compile
stack (grammars/automaton.py): pathological grammars are refused with a SchemaError that names the
limit and says what to do, a panic inside llguidance reaches the caller as one clean line, and no
grammar kills the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from foveal import grammars
from foveal.grammars import automaton
from foveal.grammars.automaton import compile_template
from foveal.grammars.errors import SchemaError, clean_native
from foveal.grammars.limits import CompileBudget, compile_budget, set_compile_budget
from foveal.grammars.specs import grammar_source
from foveal.grammars.tokenizer import tokenizer_handle

EOS = 2
NATIVE_MARKERS = (
    "panicked at",
    "stack backtrace",
    "<backtrace>",
    "/rustc/",
    ".cargo/registry",
    "RUST_BACKTRACE",
)


def alternatives(n: int) -> grammars.CFG:
    return grammars.CFG("start: " + " | ".join(f'"a{i}"' for i in range(n)))


@pytest.fixture
def default_budget():
    """Restores the process's default budget after a test that changes it."""
    yield
    set_compile_budget(None)


def test_60000_alternatives_are_refused_before_llguidance_compiles(tok, monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("llguidance's compiler must not be reached")

    monkeypatch.setattr(automaton, "_compile", no_compile)
    with pytest.raises(SchemaError) as err:
        grammars.compile(alternatives(60_000), tok, eos_token_id=EOS)
    assert err.value.limit == "max_grammar_bytes"
    message = str(err.value)
    assert "max_grammar_bytes" in message and "648,894" in message
    assert "grammars.set_compile_budget(grammars.CompileBudget(max_grammar_bytes=" in message


def test_a_grammar_over_max_items_is_refused_before_llguidance_compiles(tok, monkeypatch):
    monkeypatch.setattr(automaton, "_compile", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(SchemaError) as err:
        grammars.compile(alternatives(200), tok, eos_token_id=EOS, budget=CompileBudget(max_items=300))
    items = 199 + 200  # the `|` between 200 literals, and the literals
    assert err.value.limit == "max_items" and f"{items} alternatives and quoted strings" in str(err.value)


@pytest.mark.parametrize(
    ("budget", "spec", "field"),
    [
        (CompileBudget(max_symbols=100), alternatives(500), "max_symbols"),
        (
            CompileBudget(max_lexer_fuel=1_000),
            grammars.Regex("|".join(f"x{i}" for i in range(500))),
            "max_lexer_fuel",
        ),
    ],
    ids=["symbols", "lexer fuel"],
)
def test_llguidance_stops_at_the_budget_fuel(tok, budget, spec, field):
    """What passes the text checks still stops at a bounded amount of llguidance's own work."""
    with pytest.raises(SchemaError) as err:
        grammars.compile(spec, tok, eos_token_id=EOS, budget=budget)
    assert err.value.limit == field
    assert f"over the compile budget's {field}" in str(err.value) and f"CompileBudget({field}=" in str(
        err.value
    )


def test_the_default_budget_is_set_for_the_process(tok, default_budget):
    spec = grammars.Regex("[a-z]{3}" + "x" * 100)  # 108 bytes of pattern; more in llguidance's envelope
    set_compile_budget(CompileBudget(max_grammar_bytes=64))
    assert compile_budget().max_grammar_bytes == 64
    with pytest.raises(SchemaError, match="max_grammar_bytes"):
        grammars.compile(spec, tok, eos_token_id=EOS)
    set_compile_budget(None)
    assert compile_budget() == CompileBudget()
    assert grammars.compile(spec, tok, eos_token_id=EOS).kind == "regex"


def test_budget_fields_must_be_positive_ints():
    with pytest.raises(ValueError, match="max_items"):
        CompileBudget(max_items=0)
    with pytest.raises(ValueError, match="max_symbols"):
        CompileBudget(max_symbols=1.5)
    with pytest.raises(TypeError, match="CompileBudget"):
        set_compile_budget({"max_items": 5})


def test_a_panic_in_llguidance_becomes_one_clean_line(tok):
    """70,000 literals in a row: llguidance panics (more than u16::MAX symbols) when the budget lets it."""
    unlimited = CompileBudget(
        max_grammar_bytes=10**7, max_items=10**7, max_symbols=10**7, max_lexer_fuel=10**8
    )
    spec = grammars.CFG("start: " + " ".join('"a"' for _ in range(70_000)))
    with pytest.raises(SchemaError) as err:
        grammars.compile(spec, tok, eos_token_id=EOS, budget=unlimited)
    message = str(err.value)
    assert not any(marker in message for marker in NATIVE_MARKERS), message[:500]
    assert "\n" not in message and ".rs:" not in message and "/tmp/" not in message
    assert "more than 65,000 grammar symbols" in message and "simplify it" in message


RUST_PANICS = [
    (
        "panic: assertion failed: x < y\n<backtrace>\n   0: <unknown>\n  16: type_call\n"
        "             at /tmp/python-build/Objects/typeobject.c:1091:11\n</backtrace>",
        "assertion failed: x < y",
    ),
    (
        "thread '<unnamed>' panicked at /root/.cargo/registry/src/index.crates.io-6f17d22bba15001f/"
        "llguidance-1.0.0/src/earley/grammar.rs:123:9:\nassertion failed: x < y\nstack backtrace:\n"
        "   0: rust_begin_unwind\n             at /rustc/90b35a6239c3d8bdabc530a6a0816f7ff89a0aaf/library/"
        "std/src/panicking.rs:665:5\n   1: core::panicking::panic\nnote: Some details are omitted, run "
        "with `RUST_BACKTRACE=full` for a verbose backtrace.",
        "assertion failed: x < y",
    ),
    (
        "thread 'main' panicked at src/main.rs:2:5:\nexplicit panic\n"
        "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace",
        "explicit panic",
    ),
    ("thread 'main' panicked at 'old style', src/main.rs:2:5", "old style"),
    (
        "JSON schema refused: panic: index out of bounds\n<backtrace>\n  0: f\n      at "
        "/home/u/.cargo/registry/src/a/b.rs:1:2\n</backtrace>; pass a JSON-schema object",
        "JSON schema refused: index out of bounds; pass a JSON-schema object",
    ),
    (
        "panic: assertion `left == right` failed\n  left: 1\n right: 2\n<backtrace>\n0: x\n</backtrace>\n"
        "fix the grammar and compile again",
        "assertion `left == right` failed\nfix the grammar and compile again",
    ),
]


@pytest.mark.parametrize(("text", "clean"), RUST_PANICS, ids=range(len(RUST_PANICS)))
def test_rust_panic_text_keeps_its_first_meaningful_line_only(text, clean):
    assert clean_native(text) == clean
    assert str(SchemaError(text)) == clean  # the constructor cleans whatever it is given


def test_ordinary_messages_are_left_as_they_are():
    text = 'at 2(6): unknown name: "bar"\n   1 | start: foo\n   2 | foo: "a" | bar\n            ^\n'
    assert clean_native(text) == text


def test_llguidance_quoting_a_long_grammar_line_is_shortened(tok):
    """llguidance quotes the whole line it complains about; a one-line grammar would be quoted whole."""
    spec = grammars.CFG("start: " + " | ".join(f'"a{i}"' for i in range(5_000)) + " | undefined_rule")
    with pytest.raises(SchemaError, match="unknown name") as err:
        grammars.compile(spec, tok, eos_token_id=EOS)
    assert len(str(err.value)) < 2_000 and err.value.position == "line 1, column 8"


DEEP_CHAINS = """
import sys
from tokenizers import Tokenizer
from foveal import grammars
from foveal.testing import SMOLLM2_TOKENIZER

tok = Tokenizer.from_file(str(SMOLLM2_TOKENIZER / "tokenizer.json"))
n = 3000
specs = {
    "rule chain": grammars.CFG(
        "start: r0\\n" + "\\n".join(f'r{i}: r{i + 1} "x"' for i in range(n)) + f'\\nr{n}: "a"'
    ),
    "$ref chain": {
        "$defs": {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(1000)}
        | {"d1000": {"type": "integer"}},
        "$ref": "#/$defs/d0",
    },
}
for name, spec in specs.items():
    try:
        grammars.compile(spec, tok, eos_token_id=2)
        print(name, "compiled", flush=True)
    except grammars.SchemaError as error:
        print(name, "refused:", str(error)[:80], flush=True)
"""


def test_deep_rule_and_ref_chains_do_not_kill_the_process():
    """3,000 chained Lark rules or 1,000 chained $refs (tens of KB) overflowed the caller's stack:
    SIGSEGV, the whole server gone. Compiled on a deep stack, they are refused or compiled."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DEEP_CHAINS)], capture_output=True, text=True
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.count("\n") == 2, done.stdout


@pytest.mark.parametrize(("preset", "expected"), [(None, "0"), ("1", "1")])
def test_llguidance_errors_capture_no_backtrace_unless_asked(preset, expected):
    """With RUST_BACKTRACE=1 every error of llguidance's recursive compile captured a backtrace of the
    whole stack: a 2,000-rule chain ending in an unknown name took 40 s to be refused. Importing the
    grammar layer turns that capture off (RUST_LIB_BACKTRACE=0), unless the environment says otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "RUST_LIB_BACKTRACE"} | {"RUST_BACKTRACE": "1"}
    if preset is not None:
        env["RUST_LIB_BACKTRACE"] = preset
    script = "import os, foveal.grammars; print(os.environ.get('RUST_LIB_BACKTRACE'))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.stdout.strip() == expected, done.stderr[-1000:]


def test_a_spec_nested_past_pythons_recursion_limit_is_a_schema_error(tok):
    schema: dict = {"type": "integer"}
    for _ in range(sys.getrecursionlimit() + 100):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match="nested more deeply"):
        grammars.compile(schema, tok, eos_token_id=EOS)


def test_no_real_grammar_of_the_corpora_is_refused_by_the_default_budget(shared_dir, tok):
    """Every JSON schema and grammar of ../shared/conformance compiles within the default budget
    (a conformance test: about a minute). Specs refused for other reasons (unsupported keywords)
    are not the budget's concern."""
    from benchmarks.compile_budget import real_grammars

    handle = tokenizer_handle(tok, eos_token_id=EOS)
    seen, refused = 0, []
    for name, spec in real_grammars():
        try:
            source = grammar_source(spec)
        except SchemaError:
            continue
        seen += 1
        try:
            compile_template(handle, source, CompileBudget())
        except SchemaError as error:
            if error.limit is not None or "llguidance failed inside" in str(error):
                refused.append((name, str(error)[:120]))
    assert seen > 7_000 and refused == []
