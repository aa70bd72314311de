"""What a spec may cost: checks at compile time, so a spec that would fail or stall mid-decode is
refused before any work, with a message that names the cause.

PROBLEM: llguidance compiles some specs it then cannot decode, and reports them only at a later
mask or commit, in its own words: a `$ref` cycle with no value (`{"$ref": "#"}`) fails at the first
mask; a regex whose count llguidance cannot read (`maxLength: 10**12`) fails deep in its parser;
a lone `\\` is read as the empty regex and `a**` as `(a*)*`. And a long *forced* run (text the
grammar fixes, such as `a{100000}` or a 100 KB `const`) costs every mask step time in proportion to
its length: llguidance re-walks and re-tokenizes the whole forced text at each step (tens of
milliseconds a step for 100,000 forced bytes, against microseconds for a free `[ab]{100000}`). Masks
of a step are filled in one native call for the whole batch, so one such request delays every
request in flight (other callers' detect latency grows by an order of magnitude).
SOLUTION:
- `check_regex(pattern)` reads a regex the way its parser does (escapes, classes) and refuses a
  trailing lone backslash, a quantifier that follows a quantifier (`a**`, `a+*`; lazy `a*?` is
  fine), and a counted repetition whose lower bound exceeds MAX_FORCED_BYTES or whose upper bound
  exceeds MAX_COUNT.
- `check_schema_node(node, path)` (called on every subschema by grammars/formats.py's walk): a
  `minLength` / `minItems` / `minProperties` above MAX_MIN_LENGTH is refused (no generated answer is
  that long); a `maxLength` / `maxItems` / `maxProperties` above MAX_COUNT is lowered to MAX_COUNT
  (narrower, never wider: only strings no answer can reach are lost; llguidance's regex parser
  refuses counts past 2**32 in its own words); a `pattern` is checked as above.
- `probe(template)` computes the first mask on a copy of a freshly compiled template: a grammar
  llguidance cannot start (a pure `$ref` cycle) is refused, and so is one whose output begins with
  more than MAX_FORCED_BYTES of forced text.
Both raise SchemaError. Limits are in bytes of forced text, not time, so the verdict never depends
on the machine's load.
INVARIANTS (tests/grammars/test_valid_by_construction.py):
1. A refused spec raises SchemaError from `compile`, before any matcher exists.
2. A spec that passes starts decoding: its first mask allows at least one token.
3. The first mask of an accepted spec costs at most about MAX_FORCED_BYTES of forced text.

The compile budget (`CompileBudget`): what compiling one spec may cost.
PROBLEM: llguidance's compile time grows faster than a grammar's size: a Lark grammar of 60,000
literal alternatives takes seconds to build and is then refused anyway (its Earley row is too wide),
a grammar of about 65,000 symbols makes llguidance panic, and llguidance's own size checks run only
after most of that work. A compile cannot be interrupted (llguidance offers no cancellation of it,
and a thread that runs it cannot be stopped), so its cost must be bounded before and while it runs.
SOLUTION: two kinds of limit, each a field of `CompileBudget`:
- before compiling, `check_budget(grammar, what, budget)` measures the text llguidance would compile
  (a JSON schema's compact JSON, a Lark grammar, a regex) in one pass of str methods: its UTF-8
  size (`max_grammar_bytes`) and its items, `|` alternatives plus quoted strings (`max_items`), the
  two things a grammar's symbol count grows with; over either, SchemaError in microseconds;
- while compiling, llguidance's own fuel: `max_symbols` becomes its `max_grammar_size` (symbols of
  the compiled grammar) and `max_lexer_fuel` its `initial_lexer_fuel` (work building the lexer's
  regexes), so what passes the text checks still stops at a bounded amount of work. Both are
  counts of work, never of seconds, so the verdict does not depend on the machine's load.
The defaults are several times the largest real grammars of the conformance corpora (JSON schemas,
Lark and GBNF grammars), and the heaviest grammars they admit compile in a fraction of a second;
benchmarks/compile_budget.py measures both. `set_compile_budget` changes the process default and
`compile(..., budget=...)` one compile. A refusal names the field it hit (`SchemaError.limit`) and says
how to need less of it or raise it.
INVARIANTS (tests/grammars/test_budget.py):
4. A grammar over a text limit is refused before llguidance sees it; one over a fuel limit by
   llguidance, both as SchemaError naming the limit.
5. No real grammar of the corpora is refused by the default budget (a conformance test).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypedDict, TypeGuard, Unpack

import llguidance

from .errors import SchemaError, over_budget

# Forced text per step: about 2,000 bytes keep a mask step well under a millisecond
# (benchmarks/grammar_layer.py measures it).
MAX_FORCED_BYTES = 2048
# Counts above this are never reached by a generated answer (and the regex parser refuses > 2**32).
MAX_COUNT = 1_000_000

# A lower bound on an output's length (characters or items) above which no answer fits.
MAX_MIN_LENGTH = 10_000
_LOWER_BOUNDS = ("minLength", "minItems", "minProperties")
_UPPER_BOUNDS = ("maxLength", "maxItems", "maxProperties")

# How a refusal names the spec, by GrammarSource kind.
WHAT = {"json_schema": "JSON schema", "regex": "regex", "lark": "grammar", "choice": "list of choices"}

_COUNT = re.compile(r"\{(\d*)(,?)(\d*)\}")
_QUANTIFIERS = "*+?{"


def check_regex(pattern: str, what: str = "regex") -> None:
    """Refuse a regex llguidance would misread or that forces too much text (module docstring)."""
    i = 0
    depth = 0  # nesting of [...] classes
    after_quantifier = False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if i + 1 == len(pattern):
                raise _refusal(what, pattern, i, "it ends in a lone backslash; write \\\\ for a backslash")
            i += 2
            after_quantifier = False
            continue
        if depth:
            depth += c == "[" and not pattern.startswith("[:", i)
            depth -= c == "]"
            i += 1
            continue
        if c == "[":
            depth = 1
            i += 1 + pattern.startswith("^", i + 1)
            i += pattern.startswith("]", i)  # a `]` first in a class is a member
            after_quantifier = False
            continue
        if c in _QUANTIFIERS:
            count = _COUNT.match(pattern, i) if c == "{" else None
            if c == "{" and count is None:
                i += 1  # a literal brace
                after_quantifier = False
                continue
            if after_quantifier:
                raise _refusal(
                    what, pattern, i, "a quantifier follows a quantifier; group the first, e.g. (a*)*"
                )
            if count is not None:
                _check_count(pattern, i, count, what)
                i = count.end()
            else:
                i += 1
            i += pattern.startswith("?", i)  # lazy
            after_quantifier = True
            continue
        after_quantifier = False
        i += 1


def _check_count(pattern: str, at: int, count: re.Match, what: str) -> None:
    low, comma, high = count.groups()
    low_n = int(low) if low else 0
    high_n = int(high) if high else (None if comma else low_n)
    if low_n > MAX_FORCED_BYTES:
        raise _refusal(
            what,
            pattern,
            at,
            f"a repetition of at least {low_n:,} (more than {MAX_FORCED_BYTES:,}) makes every output "
            "that long and, repeated text being forced, slows every mask step of every request; "
            "lower the count",
        )
    if high_n is not None and high_n > MAX_COUNT:
        raise _refusal(
            what,
            pattern,
            at,
            f"a repetition of up to {high_n:,} exceeds {MAX_COUNT:,}, longer than any generated answer; "
            "use a smaller bound or an open one ({n,})",
        )


def _refusal(what: str, pattern: str, at: int, why: str) -> SchemaError:
    shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
    return SchemaError(f"invalid {what} {shown!r} at position {at} (0-based): {why}", position=str(at))


def check_schema_node(node: dict, path: str) -> dict:
    """Check one subschema's counts and pattern (module docstring); returns it, upper bounds lowered."""
    for keyword in _LOWER_BOUNDS:
        value = node.get(keyword)
        if _is_number(value) and value > MAX_MIN_LENGTH:
            raise SchemaError(
                f"{keyword!r}: {value:,} (at {path}) makes every output longer than {MAX_MIN_LENGTH:,}, "
                f"more than any answer a model generates; lower {keyword!r} or remove it",
                keyword=keyword,
                path=path,
            )
    for keyword in _UPPER_BOUNDS:
        value = node.get(keyword)
        if _is_number(value) and value > MAX_COUNT:
            node[keyword] = MAX_COUNT
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], f"'pattern' at {path}:")
    return node


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def probe(template: llguidance.LLMatcher, what: str) -> int:
    """Refuse a compiled template that cannot start or whose first step forces too much text;
    returns how many tokens the forced start takes (a lower bound on every output's length)."""
    copy = template.deep_copy()
    # The first mask before the forced text: computing it releases the GIL, and the forced-text calls,
    # which hold the GIL, then reuse its work (docs/performance.md: the time they would hold it otherwise).
    mask = copy.compute_bitmask()
    forced = copy.compute_ff_bytes()
    if len(forced) > MAX_FORCED_BYTES:
        raise SchemaError(
            f"the {what} forces {len(forced):,} or more characters of fixed text (more than "
            f"{MAX_FORCED_BYTES:,}): either a recursion with no base case, whose output never ends, or "
            "long fixed text, which llguidance re-reads at every step, slowing the mask of every request "
            "in the batch; give the recursion a base case, or put long fixed text in the prompt"
        )
    forced_tokens = len(copy.compute_ff_tokens())
    # Two steps: llguidance reports some limits (an Earley row too wide) only at the second.
    if not copy.is_error() and not copy.is_stopped():
        copy.consume_token(_first_allowed(mask))
        copy.compute_bitmask()
    if copy.is_error():
        raise SchemaError(f"the {what} cannot start: {_cause(copy.get_error())}")
    return forced_tokens


def _first_allowed(mask: bytes) -> int:
    for word, byte in enumerate(mask):
        if byte:
            return word * 8 + (byte & -byte).bit_length() - 1
    return 0


def _cause(error: str) -> str:
    first = error.splitlines()[0] if error else "unknown error"
    if first.startswith("NoExtensionBias"):
        return (
            "no output satisfies it (a $ref that only refers to itself, or a rule with no finite "
            "expansion); give the recursion a base case"
        )
    return f"{first[:200]}; simplify it"


class DecodeLimits(TypedDict, total=False):
    """llguidance's decode-time limits: the LLParserLimits keywords that `CompileBudget.parser_limits` passes on."""

    max_items_in_row: int
    step_lexer_fuel: int
    step_max_items: int
    max_lexer_states: int


@dataclass(frozen=True, slots=True)
class CompileBudget:
    """What compiling one spec may cost (module docstring); every field is a count, not a time."""

    max_grammar_bytes: int = 256 * 1024  # UTF-8 bytes of the text llguidance compiles
    max_items: int = 20_000  # `|` alternatives plus quoted strings in that text
    max_symbols: int = 10_000  # llguidance's max_grammar_size: symbols of the compiled grammar
    max_lexer_fuel: int = 500_000  # llguidance's initial_lexer_fuel: work building the lexer

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CompileBudget.{name} must be a positive int, got {value!r}")

    def parser_limits(self, **decode_limits: Unpack[DecodeLimits]) -> llguidance.LLParserLimits:
        """llguidance's limits for a compile under this budget, with the given decode-time limits."""
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_symbols, initial_lexer_fuel=self.max_lexer_fuel, **decode_limits
        )


_default_budget = CompileBudget()


def compile_budget() -> CompileBudget:
    """The budget of a compile that names none."""
    return _default_budget


def set_compile_budget(budget: CompileBudget | None) -> None:
    """Set the process's default compile budget (None: the documented defaults).

    Automata already compiled stay cached: the budget decides whether a compile may run, and a cached
    automaton's compile has already been paid for.
    """
    global _default_budget
    if budget is not None and not isinstance(budget, CompileBudget):
        raise TypeError(f"set_compile_budget takes a CompileBudget or None, got {type(budget).__name__}")
    _default_budget = budget or CompileBudget()


def check_budget(grammar: str, what: str, budget: CompileBudget) -> None:
    """Refuse a grammar text over the budget's text limits, before any compile work (module docstring)."""
    size = len(grammar)  # a character takes at least one byte: too many characters need no encoding
    if size <= budget.max_grammar_bytes and not grammar.isascii():
        size = len(grammar.encode())
    if size > budget.max_grammar_bytes:
        raise over_budget(
            what,
            f"is at least {size:,} bytes, more than {budget.max_grammar_bytes:,}",
            "max_grammar_bytes",
            "make it shorter (fewer rules and alternatives; long fixed text belongs in the prompt)",
        )
    items = grammar.count("|") + grammar.count('"') // 2
    if items > budget.max_items:
        raise over_budget(
            what,
            f"has {items:,} alternatives and quoted strings, more than {budget.max_items:,}",
            "max_items",
            "use fewer alternatives or literals (a pattern such as /a[0-9]+/ instead of every value listed)",
        )
