"""Automaton: a compiled output spec, immutable and shared by every sequence that uses it.

It holds llguidance's compiled matcher for the initial state as a template; `matcher()` deep-copies
it (~5 µs), so compiling happens once per (spec, tokenizer) and starting a sequence is cheap. The
template is the one field ever replaced: by `renew_template`, when its shared lexer is exhausted.
It carries the parser of its output text (`parse`), so a caller reads the value the spec promises
without dispatching on the spec's type again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance

from .matcher import Matcher
from .tokenizer import TokenizerHandle


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
            fresh = llguidance.LLMatcher(self.tokenizer.ll, self.grammar, log_level=0, limits=parser_limits())
            object.__setattr__(self, "template", fresh)  # a cache refresh, not a change of meaning


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's limits with a wider Earley row: a choice among 5,000 literals in a CFG decodes
    (the default row of 2,000 items failed at the second step). The cost of a step stays bounded by
    llguidance's per-step item cap (50,000 items, ~2.5 ms), which is unchanged."""
    return llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW)


MAX_ITEMS_IN_ROW = 20_000


def compile_template(handle: TokenizerHandle, source: Any) -> llguidance.LLMatcher:
    """Compile a GrammarSource for a tokenizer; refusals become SchemaError (before any decoding)."""
    from .errors import pattern_refusal, schema_refusal

    template = llguidance.LLMatcher(handle.ll, source.grammar, log_level=0, limits=parser_limits())
    if template.is_error():
        message = template.get_error()
        if source.kind == "json_schema":
            raise schema_refusal(message, source.schema)
        raise pattern_refusal("regex" if source.kind == "regex" else "grammar", source.key, message)
    return template
