"""`compile(spec, tokenizer) -> Automaton`, with the bounded LRU of compiled automata.

The cache key is the spec's canonical text (JSON schema text with its key order, pattern, grammar,
or a spatial spec's fields) plus the tokenizer identity (vocabulary hash, EOS, model vocab size),
so equal specs from different Python objects share one automaton. Before an automaton is cached,
grammars/limits.py refuses what would fail or stall mid-decode (SchemaError, before any work); the
automaton carries the parser of its text (`Automaton.parse`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from . import spatial
from .automaton import Automaton, compile_template
from .cache import LRUCache
from .limits import check_regex, probe
from .spatial import SpatialSpec
from .specs import grammar_source
from .tokenizer import tokenizer_handle

AUTOMATA: LRUCache[Automaton] = LRUCache(maxsize=512)
_WHAT = {"json_schema": "JSON schema", "regex": "regex", "lark": "grammar", "choice": "list of choices"}


def compile(
    spec: Any, tokenizer: Any, *, eos_token_id: int | None = None, vocab_size: int | None = None
) -> Automaton:
    """Compile an output spec for a tokenizer (cached). Raises SchemaError before any decoding.

    `vocab_size` is the model's vocabulary (embedding rows) when larger than the tokenizer's;
    bitmasks then have ceil(vocab_size/32) words per row and the extra ids are never allowed.
    `eos_token_id` is required for a raw `tokenizers.Tokenizer` (it does not know its EOS).
    """
    handle = tokenizer_handle(tokenizer, eos_token_id=eos_token_id, vocab_size=vocab_size)
    if isinstance(spec, SpatialSpec):
        key = f"{spec.cache_key()}|{handle.key}"
        cached = AUTOMATA.get(key)
        if cached is None:
            cached = replace(spec.build(handle, key), parse=functools.partial(spatial.parse, spec))
            AUTOMATA.put(key, cached)
        return cached
    source = grammar_source(spec)
    key = f"{source.key}|{handle.key}"
    cached = AUTOMATA.get(key)
    if cached is None:
        if source.pattern is not None:
            check_regex(source.pattern)
        template = compile_template(handle, source)
        forced_tokens = probe(template, _WHAT[source.kind])
        cached = Automaton(
            key=key,
            kind=source.kind,
            grammar=source.grammar,
            tokenizer=handle,
            template=template,
            parse=source.parse,
            min_tokens=forced_tokens,
        )
        AUTOMATA.put(key, cached)
    return cached


def parser_of(spec: Any) -> Callable[[str], Any]:
    """The parser `compile(spec, ...)` would attach (`Automaton.parse`), without a tokenizer.

    For callers that need the parser before they compile; it resolves the spec through the same
    dispatch (grammars/specs.py), so the two always agree. Raises SchemaError like compile.
    """
    if isinstance(spec, SpatialSpec):
        return functools.partial(spatial.parse, spec)
    return grammar_source(spec).parse
