"""`compile(spec, tokenizer) -> Automaton`, with the bounded LRU of compiled automata.

The cache key is the spec's canonical text (JSON schema text with its key order, pattern, grammar,
or a spatial spec's fields) plus the tokenizer identity (vocabulary hash, EOS, model vocab size),
so equal specs from different Python objects share one automaton.
"""

from __future__ import annotations

from typing import Any

from .automaton import Automaton, compile_template
from .cache import LRUCache
from .spatial import SpatialSpec
from .specs import grammar_source
from .tokenizer import tokenizer_handle

AUTOMATA: LRUCache[Automaton] = LRUCache(maxsize=512)


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
            cached = spec.build(handle, key)
            AUTOMATA.put(key, cached)
        return cached
    source = grammar_source(spec)
    key = f"{source.key}|{handle.key}"
    cached = AUTOMATA.get(key)
    if cached is None:
        template = compile_template(handle, source)
        cached = Automaton(
            key=key, kind=source.kind, grammar=source.grammar, tokenizer=handle, template=template
        )
        AUTOMATA.put(key, cached)
    return cached
