"""`compile(spec, tokenizer) -> Automaton`, with the bounded LRU of compiled automata.

The cache key is the spec's canonical text (JSON schema text with its key order, pattern, grammar,
or a spatial spec's fields) plus the tokenizer identity (vocabulary hash, EOS, model vocab size),
so equal specs from different Python objects share one automaton. Before an automaton is cached,
grammars/limits.py refuses what would fail or stall mid-decode (SchemaError, before any work) and
what would cost more to compile than the compile budget allows, and grammars/exact_numbers.py a JSON
schema's numbers that llguidance would approximate; the automaton carries the parser of its text
(`Automaton.parse`).

Threads: `compile` may be called from any number of threads at once, and holds no lock while it
compiles. The cache builds each key once (grammars/cache.py): a caller asking for a spec that
another thread is compiling waits for that compile and gets the same automaton (or the same
SchemaError); compiles of different specs run in parallel (llguidance releases the GIL while it
compiles). The budget is not part of the key: its text limits are checked on every call (they
depend on the spec alone), its fuel limits when a compile runs, so a spec compiled under a larger
budget is returned from the cache to a caller whose budget is smaller but admits its text. A caller
that waits for another's compile of the same spec gets that compile's outcome, under its budget.
Spatial specs are built by the layer itself (grammars/spatial.py) under the default budget.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from . import spatial
from .automaton import Automaton, compile_template
from .cache import LRUCache
from .errors import SchemaError
from .exact_numbers import check_exact_numbers
from .limits import WHAT, CompileBudget, check_budget, check_regex, compile_budget, probe
from .spatial import SpatialSpec
from .specs import GrammarSource, grammar_source
from .tokenizer import TokenizerHandle, tokenizer_handle

AUTOMATA: LRUCache[Automaton] = LRUCache(maxsize=512)


def compile(
    spec: Any,
    tokenizer: Any,
    *,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
    budget: CompileBudget | None = None,
) -> Automaton:
    """Compile an output spec for a tokenizer (cached). Raises SchemaError before any decoding.

    `vocab_size` is the model's vocabulary (embedding rows) when larger than the tokenizer's;
    bitmasks then have ceil(vocab_size/32) words per row and the extra ids are never allowed.
    `eos_token_id` is required for a raw `tokenizers.Tokenizer` (it does not know its EOS).
    `budget` bounds what the compile may cost (grammars/limits.py); None: the process default
    (`grammars.set_compile_budget`).
    """
    handle = tokenizer_handle(tokenizer, eos_token_id=eos_token_id, vocab_size=vocab_size)
    if isinstance(spec, SpatialSpec):
        key = f"{spec.cache_key()}|{handle.key}"
        return AUTOMATA.get_or_build(
            key, lambda: replace(spec.build(handle, key), parse=functools.partial(spatial.parse, spec))
        )
    source = _source(spec)
    budget = budget or compile_budget()
    check_budget(source.grammar, WHAT[source.kind], budget)  # before the key: a refusal costs no hashing
    key = f"{source.key}|{handle.key}"
    return AUTOMATA.get_or_build(key, lambda: _build(source, handle, key, budget))


def _source(spec: Any) -> GrammarSource:
    try:
        return grammar_source(spec)
    except RecursionError:
        raise SchemaError(
            "the spec is nested more deeply than Python's recursion limit allows; flatten it "
            "(a $ref to a definition instead of nesting the same shape again)"
        ) from None


def _build(source: GrammarSource, handle: TokenizerHandle, key: str, budget: CompileBudget) -> Automaton:
    if source.pattern is not None:
        check_regex(source.pattern)
    template = compile_template(handle, source, budget)
    if source.kind == "json_schema":
        # After llguidance's own refusals (a bound beyond its range keeps its message), before any decoding.
        check_exact_numbers(source.schema)  # numbers llguidance would approximate (grammars/exact_numbers.py)
    forced_tokens = probe(template, WHAT[source.kind])
    return Automaton(
        key=key,
        kind=source.kind,
        grammar=source.grammar,
        tokenizer=handle,
        template=template,
        parse=source.parse,
        min_tokens=forced_tokens,
    )


def parser_of(spec: Any) -> Callable[[str], Any]:
    """The parser `compile(spec, ...)` would attach (`Automaton.parse`), without a tokenizer.

    For callers that need the parser before they compile; it resolves the spec through the same
    dispatch (grammars/specs.py), so the two always agree. Raises SchemaError like compile.
    """
    if isinstance(spec, SpatialSpec):
        return functools.partial(spatial.parse, spec)
    return grammar_source(spec).parse
