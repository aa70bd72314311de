"""A tokenizer as the grammar layer needs it: llguidance's LLTokenizer plus an identity key.

PROBLEM: building an LLTokenizer from a large vocabulary is slow (a fraction of a second for 49k
tokens: docs/performance.md), and the compile cache
needs a key that says "same vocabulary, same EOS, same model vocab size" for different Python
objects loaded from the same files.
SOLUTION: `tokenizer_handle()` serializes the tokenizer once (tokenizers JSON), hashes it into the
identity key, and keeps the built LLTokenizer in a small LRU keyed by that identity. Lookups by the
same Python object skip the serialization (a second LRU keyed by object id, holding the object so
the id stays valid).

Special-token text is plain text. The text of a spec (a regex, a CFG string literal, a JSON string)
never matches a special token: `Regex("<|im_end|>x")` is spelled with ordinary tokens `<`, `|`, ...
A Lark grammar allows a special token only where it names one (`<|im_end|>` or `<[2]>` syntax).
Why it needs care: llguidance computes the mask over forced text ("the next bytes must be
`<|im_end|>x`") by tokenizing that text, and a `tokenizers.Tokenizer` always splits special-token text
into the special token, while the token trie (what `commit` checks) gives special tokens bytes no
text can match. The mask then allowed a token that commit refused. So llguidance gets the
tokenizer through a `TokenizerWrapper` whose encoder has `encode_special_tokens = True` (special-token
text tokenized as text); token bytes and special-token ids are those llguidance reads from the
tokenizer's JSON, so masks are otherwise unchanged (reading them is the slow part of a handle, so
they are kept on disk between processes: token_tables.py).
INVARIANTS: equal keys <=> equal vocabulary bytes, EOS id and vocab size; a model vocab size larger
than the tokenizer's is built in (ids past the tokenizer's are never allowed by any mask); a mask
never allows a token that `commit` refuses, special-token text included.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import llguidance
import tokenizers

from . import token_tables
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
    ll = _plain_text_tokenizer(backend, text, digest, eos, size)
    handle = TokenizerHandle(key=key, ll=ll, eos_token_id=eos, vocab_size=size, source=backend)
    _BY_IDENTITY.put(key, handle)
    return handle


class _PlainTextEncoder:
    """What llguidance's TokenizerWrapper reads: token bytes, special ids, and an encoder that
    reads special-token text as text (see the module docstring)."""

    bos_token_id = None

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokenizer_json: str,
        table: tuple[list[bytes], list[int]],
        eos: int,
    ) -> None:
        self.eos_token_id = eos
        self.tokens, self.special_token_ids = table
        self._encoder = _encoder_reading_added_tokens_as_text(
            backend, tokenizer_json, set(self.special_token_ids)
        )

    def __call__(self, text: str) -> list[int]:
        return self._encoder.encode(text, add_special_tokens=False).ids


def _encoder_reading_added_tokens_as_text(
    backend: tokenizers.Tokenizer, tokenizer_json: str, special_ids: set[int]
) -> tokenizers.Tokenizer:
    """The tokenizer with every token llguidance treats as special read as text when it appears in text.

    `encode_special_tokens` covers only added tokens flagged `special`; added tokens that are not
    (PaliGemma's `<locNNNN>`, `<segNNN>`) would still be split out of the text, and llguidance
    gives them no text either. So those get the flag in a private copy rebuilt from the JSON first.
    Where every such token is flagged already (most tokenizers), `backend` itself is the encoder:
    the grammar layer's private copy (`_build`), whose only other use reads token ids' strings,
    which the flag does not change (so the rebuild is skipped).
    """
    added = backend.get_added_tokens_decoder()
    if all(token.special for index, token in added.items() if index in special_ids):
        backend.encode_special_tokens = True
        return backend
    data = json.loads(tokenizer_json)
    for entry in data.get("added_tokens", []):
        if entry["id"] in special_ids:
            entry["special"] = True
    encoder = tokenizers.Tokenizer.from_str(json.dumps(data))
    encoder.encode_special_tokens = True
    return encoder


def _plain_text_tokenizer(
    backend: Any, text: str, digest: str, eos: int, size: int
) -> llguidance.LLTokenizer:
    table = token_tables.token_table(text, digest, eos, size)
    wrapper = llguidance.TokenizerWrapper(_PlainTextEncoder(backend, text, table, eos))
    return llguidance.LLTokenizer(wrapper, n_vocab=size, eos_token=eos)
