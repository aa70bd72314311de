"""A tokenizer as the grammar layer needs it: llguidance's LLTokenizer plus an identity key.

PROBLEM: building an LLTokenizer from a 49k-token vocabulary costs ~0.2 s, and the compile cache
needs a key that says "same vocabulary, same EOS, same model vocab size" for different Python
objects loaded from the same files.
SOLUTION: `tokenizer_handle()` serializes the tokenizer once (tokenizers JSON), hashes it into the
identity key, and keeps the built LLTokenizer in a small LRU keyed by that identity. Lookups by the
same Python object skip the serialization (a second LRU keyed by object id, holding the object so
the id stays valid).
INVARIANTS: equal keys <=> equal vocabulary bytes, EOS id and vocab size; a model vocab size larger
than the tokenizer's is built in (ids past the tokenizer's are never allowed by any mask).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Any

import llguidance

from .cache import LRUCache

_BY_IDENTITY: LRUCache[TokenizerHandle] = LRUCache(maxsize=8)
_BY_OBJECT: LRUCache[tuple[Any, str]] = LRUCache(maxsize=16)


@dataclass(slots=True)
class TokenizerHandle:
    """One (tokenizer, EOS, vocab size) the grammar layer compiles against; shared by automata."""

    key: str
    ll: llguidance.LLTokenizer
    eos_token_id: int
    vocab_size: int  # the model's vocabulary (bitmask width is ceil(vocab_size / 32) words)
    source: Any  # the tokenizers.Tokenizer (for token_to_id)
    _token_bytes: list[bytes] | None = field(default=None, repr=False)

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def token_to_id(self, token: str) -> int | None:
        return self.source.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        if 0 <= token_id < self.ll.vocab_size:
            return (
                self.ll.decode_str([token_id])
                if not self.ll.is_special_token(token_id)
                else self.source.id_to_token(token_id) or f"<special {token_id}>"
            )
        return f"<id {token_id} outside the vocabulary>"

    def token_bytes(self) -> list[bytes]:
        """Bytes of every token id (special tokens: b""), built once, for byte-level bookkeeping."""
        if self._token_bytes is None:
            special = self.ll.is_special_token
            self._token_bytes = [
                b"" if special(i) else self.ll.decode_bytes([i]) for i in range(self.ll.vocab_size)
            ]
        return self._token_bytes


def tokenizer_handle(
    tokenizer: Any, *, eos_token_id: int | None = None, vocab_size: int | None = None
) -> TokenizerHandle:
    """The shared handle for a `tokenizers.Tokenizer` or a transformers fast tokenizer."""
    backend, default_eos = _backend(tokenizer)
    eos = eos_token_id if eos_token_id is not None else default_eos
    if eos is None:
        raise ValueError(
            "this tokenizer does not say which token ends a sequence; "
            "pass eos_token_id=... to grammars.compile"
        )
    obj_key = f"{id(tokenizer)}:{eos}:{vocab_size}"
    hit = _BY_OBJECT.get(obj_key)
    if hit is not None and hit[0] is tokenizer:
        cached = _BY_IDENTITY.get(hit[1])
        if cached is not None:
            return cached
    handle = _build(backend, eos, vocab_size)
    _BY_OBJECT.put(obj_key, (tokenizer, handle.key))
    return handle


def _backend(tokenizer: Any) -> tuple[Any, int | None]:
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer, None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        return backend, getattr(tokenizer, "eos_token_id", None)
    raise TypeError(
        f"unsupported tokenizer {type(tokenizer).__name__}; pass a tokenizers.Tokenizer "
        "or a transformers fast tokenizer (use_fast=True)"
    )


def _build(backend: Any, eos: int, vocab_size: int | None) -> TokenizerHandle:
    backend = copy.copy(backend)  # padding/truncation settings must not leak into the grammar layer
    backend.no_padding()
    backend.no_truncation()
    text = backend.to_str()
    own_size = backend.get_vocab_size(with_added_tokens=True)
    size = own_size if vocab_size is None else vocab_size
    if size < own_size:
        raise ValueError(
            f"vocab_size={size} is smaller than the tokenizer's {own_size} tokens; "
            "pass the model's vocabulary size (embedding rows)"
        )
    if not 0 <= eos < size:
        raise ValueError(f"eos_token_id={eos} is outside the vocabulary (size {size})")
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    key = f"{digest}:eos={eos}:V={size}"
    cached = _BY_IDENTITY.get(key)
    if cached is not None:
        return cached
    ll = llguidance.LLTokenizer(text, n_vocab=size, eos_token=eos)
    handle = TokenizerHandle(key=key, ll=ll, eos_token_id=eos, vocab_size=size, source=backend)
    _BY_IDENTITY.put(key, handle)
    return handle
