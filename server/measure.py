"""`check_fits`: a request's text measured against the model's context before anything tokenizes it whole.

PROBLEM
    The SDK tokenizes a prompt whole, then compares its length with the context. A tokenizer's
    encode holds the GIL for its whole run, so a 10 MB question took most of a minute to be refused
    (docs/performance.md), held the event loop (and /health) for seconds, and grew the process by
    gigabytes, for an answer known
    from its first few kilobytes.
SOLUTION
    Texts of at most MEASURE_FROM_CHARS characters in all are left to the SDK (whole, they tokenize
    in a few milliseconds). Above that:
    1. A bound with no tokenizer: no token covers more than `longest` characters of text (the
       longest token of the vocabulary, special tokens included), and a normalizer merges at most
       NORMALIZER_SHRINK characters into one, so a text longer than NORMALIZER_SHRINK x longest x
       context characters cannot fit: refused at once.
    2. Otherwise the texts are tokenized in slices of SLICE_CHARS characters (cut at whitespace where
       there is some), in a worker thread that hands the GIL back between slices, and counted; a
       slice boundary can split a token that the whole text would keep (CUT_SLACK tokens per cut are
       taken off), and the count stops as soon as it is over the context: refused.
    A text that passes goes to the SDK, which counts it exactly (with the template and the image)
    and refuses it if, with everything else, it does not fit.
INVARIANTS
    - A text is refused here only if it cannot fit in the context on its own.
    - At most about `context` tokens' worth of text is tokenized here, in slices of SLICE_CHARS.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from foveal.server.errors import ApiError

MEASURE_FROM_CHARS = 8192
SLICE_CHARS = 2048  # about a millisecond of tokenizing
NORMALIZER_SHRINK = 4  # NFC/NFKC compose at most a few characters into one
CUT_SLACK = 4


async def check_fits(model: Any, texts: Sequence[tuple[str, str]]) -> None:
    """ApiError 400 when `texts` ((param, text) pairs, in prompt order) cannot fit in `model`'s context."""
    texts = [(param, text.strip()) for param, text in texts]  # as the SDK takes them: never more tokens
    chars = sum(len(text) for _, text in texts)
    if chars <= MEASURE_FROM_CHARS:
        return
    context = model.engine.config.max_model_len
    tokenizer = model.family.tokenizer
    longest = _longest_token(tokenizer)
    param = max(texts, key=lambda pair: len(pair[1]))[0]
    if chars > NORMALIZER_SHRINK * longest * context:
        floor = math.ceil(chars / (NORMALIZER_SHRINK * longest))
        raise _too_long(param, chars, floor, context)
    counted = await asyncio.to_thread(_count_until, _counter(tokenizer), [text for _, text in texts], context)
    if counted is not None:
        raise _too_long(param, chars, counted, context)


def _too_long(param: str, chars: int, tokens: int, context: int) -> ApiError:
    return ApiError(
        400,
        f"{param}: the text has {chars} characters, at least {tokens} tokens, more than this model's "
        f"context of {context} tokens (max_model_len) holds; shorten it",
        param=param,
    )


def _count_until(count: Callable[[str], int], texts: list[str], context: int) -> int | None:
    """The tokens found (less CUT_SLACK per cut) once they exceed `context`; None if they never do."""
    total = cuts = 0
    for text in texts:
        start = 0
        while start < len(text):
            end = _cut(text, start)
            total += count(text[start:end])
            cuts += 1  # a slice's end, or a text's: the prompt joins texts to other tokens
            if total - CUT_SLACK * cuts > context:
                return total - CUT_SLACK * cuts
            start = end
    return None


def _cut(text: str, start: int) -> int:
    """The end of the slice from `start`: SLICE_CHARS on, moved back to a whitespace when one is near."""
    end = start + SLICE_CHARS
    if end >= len(text):
        return len(text)
    for i in range(end, end - 64, -1):
        if text[i].isspace():
            return i
    return end


def _counter(tokenizer: Any) -> Callable[[str], int]:
    """The token count of a text, without special tokens, from the fastest interface the tokenizer has."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if hasattr(backend, "encode") and hasattr(backend, "get_vocab_size"):  # a tokenizers.Tokenizer
        return lambda text: len(backend.encode(text, add_special_tokens=False).ids)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


@functools.lru_cache(maxsize=8)
def _longest_token(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for (its longest vocabulary entry: a
    byte-level entry's characters are its bytes, at least the characters it covers)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    vocab = backend.get_vocab(with_added_tokens=True) if hasattr(backend, "get_vocab_size") else tokenizer.get_vocab()
    return max(1, max(len(token) for token in vocab))
