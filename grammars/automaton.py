"""Automaton: a compiled output spec, immutable and shared by every sequence that uses it.

It holds llguidance's compiled matcher for the initial state as a template; `matcher()` deep-copies
it (~5 µs), so compiling happens once per (spec, tokenizer) and starting a sequence is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import llguidance

from .matcher import Matcher
from .tokenizer import TokenizerHandle


@dataclass(frozen=True, slots=True)
class Automaton:
    """Compiled spec; never mutated after `compile()` returns it (safe to share across threads)."""

    key: str
    kind: str
    grammar: str
    tokenizer: TokenizerHandle
    template: llguidance.LLMatcher = field(repr=False)
    matcher_class: type[Matcher] = Matcher
    extra: Any = field(default=None, repr=False)  # data a composite matcher class needs

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def matcher(self) -> Matcher:
        """A fresh Matcher at the start of the output."""
        return self.matcher_class(self, self.template.deep_copy())


def compile_template(handle: TokenizerHandle, source: Any) -> llguidance.LLMatcher:
    """Compile a GrammarSource for a tokenizer; refusals become SchemaError (before any decoding)."""
    from .errors import pattern_refusal, schema_refusal

    template = llguidance.LLMatcher(handle.ll, source.grammar, log_level=0)
    if template.is_error():
        message = template.get_error()
        if source.kind == "json_schema":
            raise schema_refusal(message, source.schema)
        raise pattern_refusal("regex" if source.kind == "regex" else "grammar", source.key, message)
    return template
