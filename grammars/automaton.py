"""Automaton: a compiled output spec, immutable and shared by every sequence that uses it.

It holds llguidance's compiled matcher for the initial state as a template; `matcher()` deep-copies
it (~5 µs), so compiling happens once per (spec, tokenizer) and starting a sequence is cheap. The
template is the one field ever replaced: by `renew_template`, when its shared lexer is exhausted.
It carries the parser of its output text (`parse`), so a caller reads the value the spec promises
without dispatching on the spec's type again.

`compile_template` is the one place a spec's grammar reaches llguidance's compiler: it checks the
compile budget first (grammars/limits.py), compiles under the budget's fuel, and turns refusals and
panics into SchemaError (grammars/errors.py). `lark_automaton` is how a spec's own `build` (a
family's answer format) makes an Automaton of its Lark text, without importing llguidance itself.
Stack depth: llguidance compiles rule references and `$ref`s recursively on the calling thread's
stack. A chain of a few thousand Lark rules (`r0: r1`, `r1: r2`, ...) or of about a thousand
nested `$ref`s, tens of KB of text, overflows an 8 MiB thread stack, and a stack overflow kills
the process (SIGSEGV: no exception, no error). The deepest need seen is a few hundred bytes of
stack per byte of grammar text. So a grammar longer than INLINE_BYTES, which a thread's default stack
holds with room to spare, is compiled on a short-lived thread whose stack has STACK_PER_BYTE bytes per
byte of the grammar (address space, touched only as deep as the compile goes: 256 MiB for the
largest grammar the default budget admits); the caller waits for it. Decoding does not recurse
this way; renewing a template (a recompile) takes the same path.
Error backtraces: with RUST_BACKTRACE=1 in the environment (common in development images), every
error llguidance creates captures a backtrace of the whole (deep) stack, at every level of its
recursive compile, and a long rule chain ending in an unknown name took hundreds of times longer to
be refused (docs/performance.md). Nobody reads those backtraces (the message is what the caller gets), so importing this
module sets RUST_LIB_BACKTRACE=0 unless the environment sets it, which turns off the capture for
library errors and leaves panics' backtraces as RUST_BACKTRACE says.
INVARIANTS (tests/grammars/test_budget.py): no grammar within the budget crashes the process; the
template is compiled once and only read afterwards, so automata are shared between threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance

from .errors import budget_refusal, native_failure, pattern_refusal, schema_refusal
from .limits import WHAT, CompileBudget, DecodeLimits, check_budget, compile_budget
from .matcher import Matcher
from .specs import GrammarSource
from .tokenizer import TokenizerHandle

os.environ.setdefault("RUST_LIB_BACKTRACE", "0")  # before llguidance's first error (module docstring)


@dataclass(frozen=True, slots=True)
class Automaton:
    """Compiled spec; its meaning never changes after `compile()` (safe to share across threads)."""

    key: str
    kind: str
    grammar: str
    tokenizer: TokenizerHandle
    template: llguidance.LLMatcher = field(repr=False)
    matcher_class: type[Matcher] = Matcher
    extra: Any = field(default=None, repr=False)  # data a composite matcher class needs
    parse: Callable[[str], Any] = field(default=str, repr=False)  # the output's text -> its value
    min_tokens: int = 0  # tokens every output takes at least (its forced start), for budget checks

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def matcher(self) -> Matcher:
        """A fresh Matcher at the start of the output."""
        return self.matcher_class(self, self.template.deep_copy())

    def renew_template(self, exhausted: llguidance.LLMatcher) -> None:
        """Replace the template whose shared lexer hit a resource limit with a fresh compile.

        llguidance's lexer DFA is shared by all deep copies of a template and its error state is
        sticky, so without this one over-long output would fail every later matcher of the
        automaton. Only the template a failing matcher came from is replaced (several failing
        matchers renew once). The grammar text is unchanged, so the automaton's meaning is too.
        """
        if self.template is exhausted:
            # The grammar compiled once already: renewing it needs no budget, only the same decode limits.
            fresh = _compile(self.tokenizer.ll, self.grammar, llguidance.LLParserLimits(**DECODE_LIMITS))
            object.__setattr__(self, "template", fresh)  # a cache refresh, not a change of meaning


def parser_limits(budget: CompileBudget | None = None) -> llguidance.LLParserLimits:
    """llguidance's limits: the compile budget's fuel (grammars/limits.py) and a wider Earley row: a
    choice among 5,000 literals in a CFG decodes (the default row of 2,000 items failed at the second
    step). The cost of a step stays bounded by llguidance's per-step item cap (50,000 items), which
    is unchanged."""
    return (budget or compile_budget()).parser_limits(**DECODE_LIMITS)


MAX_ITEMS_IN_ROW = 20_000
DECODE_LIMITS: DecodeLimits = {"max_items_in_row": MAX_ITEMS_IN_ROW}
INLINE_BYTES = 4 * 1024  # compiled on the caller's stack up to this size (module docstring)
STACK_PER_BYTE = 1024  # stack bytes per byte of grammar text: a few times the deepest need seen
MIN_STACK = 16 * 1024 * 1024


def compile_template(
    handle: TokenizerHandle, source: Any, budget: CompileBudget | None = None
) -> llguidance.LLMatcher:
    """Compile a GrammarSource for a tokenizer under a compile budget (None: the process default);
    refusals become SchemaError, before any decoding."""
    budget = budget or compile_budget()
    what = WHAT.get(source.kind, "grammar")
    check_budget(source.grammar, what, budget)
    template = _compile(handle.ll, source.grammar, parser_limits(budget))
    if template.is_error():
        message = template.get_error()
        refusal = budget_refusal(message, what) or native_failure(message, what)
        if refusal is not None:
            raise refusal
        if source.kind == "json_schema":
            raise schema_refusal(message, source.schema)
        raise pattern_refusal("regex" if source.kind == "regex" else "grammar", source.key, message)
    return template


def lark_automaton(
    handle: TokenizerHandle,
    key: str,
    kind: str,
    lark: str,
    matcher_class: type[Matcher] = Matcher,
    extra: Any = None,
) -> Automaton:
    """The Automaton of a spec's Lark grammar (llguidance dialect; token sets such as `<[5-9]>` allowed,
    unlike a user's CFG): `key` the spec's cache key, `kind` what it is, a composite `matcher_class` and
    the `extra` data it reads."""
    source = GrammarSource("lark", key, llguidance.LLMatcher.grammar_from_lark(lark))
    template = compile_template(handle, source)
    return Automaton(key, kind, lark, handle, template, matcher_class=matcher_class, extra=extra)


def _compile(
    ll: llguidance.LLTokenizer, grammar: str, limits: llguidance.LLParserLimits
) -> llguidance.LLMatcher:
    """llguidance's compile; a grammar over INLINE_BYTES on a thread with a deep stack (module docstring)."""
    if len(grammar) <= INLINE_BYTES:
        return llguidance.LLMatcher(ll, grammar, log_level=0, limits=limits)
    stack = max(STACK_PER_BYTE * len(grammar.encode()), MIN_STACK)
    stack = -(-stack // (1 << 20)) << 20  # whole MiB: some platforms want stack sizes in whole pages
    done: list[llguidance.LLMatcher | BaseException] = []

    def run() -> None:
        try:
            done.append(llguidance.LLMatcher(ll, grammar, log_level=0, limits=limits))
        except BaseException as error:  # llguidance raises only on API misuse; hand it to the caller
            done.append(error)

    with _STACK_SIZE_LOCK:  # threading.stack_size is process-wide: set it for this one thread's start
        previous = threading.stack_size(stack)
        try:
            thread = threading.Thread(target=run, name="foveal-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


_STACK_SIZE_LOCK = threading.Lock()
