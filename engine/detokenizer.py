"""Incremental, UTF-8 safe detokenization and stop-string detection for one sequence.

PROBLEM
    Tokens are byte sequences: a character can be split across tokens, and decoding a token alone
    can lose a leading space (SentencePiece) or yield U+FFFD for half a character. Decoding the
    whole output at every token is quadratic. And this runs for every row at every commit, on the
    scheduler thread: its cost per token is host time the pipeline must hide.
SOLUTION
    Decode a short window: the tokens since the last stable point (`prefix`) with and without the
    new ones; the new text is the difference, released only when it does not end in U+FFFD.
    When the tokenizer is a `tokenizers.Tokenizer`, or is backed by one that decodes to the same text
    (a transformers fast tokenizer without space clean-up), that window step is tokenizers' own
    `DecodeStream`: the same algorithm in one native call per token, faster than two `decode` calls
    from Python and than a transformers tokenizer (docs/performance.md). Otherwise it runs here. Either way `_prefix` and `_read` follow the window, for `flush`.
    Stop strings are searched in the new text plus the tail that could hold a stop's start; text
    that could still be the beginning of a stop string is held back from the stream.
INVARIANTS
    - The concatenation of released deltas equals the final text.
    - No released text contains U+FFFD from a split character, nor any part of a matched stop.
    - The native and the Python window steps release the same text for the same tokens.
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream


def native_decoder(tokenizer: Any) -> tokenizers.Tokenizer | None:
    """The `tokenizers.Tokenizer` whose `decode` gives exactly `tokenizer.decode`'s text, if any.

    None for a tokenizer that spells ids its backend does not know (`spells_values`: Moondream's
    region values, engine/regions.py): only its own `decode` gives their text."""
    if getattr(tokenizer, "spells_values", False):
        return None
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' fast tokenizers
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):
        return backend
    return None


class Detokenizer:
    def __init__(
        self, tokenizer: Any, stop: tuple[str, ...] = (), skip_special_tokens: bool = True, native: bool = True
    ) -> None:
        """`skip_special_tokens=False` keeps special tokens' text (formats that answer in them, such as
        location tokens); `native=False` runs the window step in Python even when tokenizers could."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._native = native_decoder(tokenizer) if native else None
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._native is not None else None
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this are already in `text`
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all decoded text so far (cut before a stop string once one is found)
        self.released = 0  # characters of `text` handed to the stream
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_id: int) -> None:
        """Append one token; sets `stopped` if the text now contains a stop string."""
        self._ids.append(token_id)
        if self._stream is not None:
            assert self._native is not None  # the stream is made with it
            new = self._stream.step(self._native, token_id)
        elif self._tokenizer is not None:
            new = self._window_step()
        else:
            return
        if not new:
            return
        start = max(0, len(self.text) - self._hold)
        self.text += new
        self._prefix, self._read = self._read, len(self._ids)
        if self._stop:
            self._find_stop(start)

    def _window_step(self) -> str | None:
        """The text the newest token completes, or None while it ends inside a character."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        return after[len(before) :]

    def _find_stop(self, start: int) -> None:
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def flush(self) -> None:
        """At the end: decode what is left, even an incomplete character."""
        if self._tokenizer is not None and self._read < len(self._ids) and not self.stopped:
            before = self._decode(self._ids[self._prefix : self._read])
            start = max(0, len(self.text) - self._hold)
            self.text += self._decode(self._ids[self._prefix :])[len(before) :]
            self._read = len(self._ids)
            self._find_stop(start)

    def release(self, final: bool) -> str:
        """The next delta for the stream; keeps back what could start a stop string unless `final`."""
        end = len(self.text) if final or self.stopped else max(self.released, len(self.text) - self._hold)
        delta = self.text[self.released : end]
        self.released = end
        return delta
