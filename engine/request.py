"""What a caller submits (`Request`, `SamplingParams`, `PrefillInputs`) and what it gets back
(`RequestHandle`, `RequestOutput` and its `Timings`).

`PrefillInputs` is the typed contract between a family's processor, the SDK and the runner: what a
prompt needs beyond its token ids (image tensors, the image's content key, how many placeholder
tokens the image fills, PaliGemma's bidirectional prefix). The engine carries it to the prefill
launch untouched.

A `RequestHandle` is shared by two threads: the engine thread pushes text deltas and the final
`RequestOutput`; the caller iterates deltas, waits for `result()`, or calls `cancel()`. All state
changes happen under one condition variable, so a delta is never lost or seen twice, and a handle
always ends (finished, cancelled, failed or shut down): nobody waits forever on it. A delta wakes
only callers iterating deltas (a caller blocked in `result()` would wake every step for nothing,
taking the GIL from the engine's threads); the finish wakes everyone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .matcher import Matcher

SEED_LIMIT = 2**64  # seeds are unsigned 64-bit; the sampler hashes all 64 bits
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs allows 0..20)


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token or string, or the grammar terminated
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # cancel() or engine shutdown
    ERROR = "error"  # the request failed (e.g. its matcher refused a token); see RequestOutput.error


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters; seed None draws one at submit.

    skip_special_tokens=False keeps special tokens in the output text (for formats that answer in
    them, such as location tokens); stop strings are then matched against that text.

    logprobs=k records each output token's log-probability and its k most likely alternatives
    (k in 0..MAX_LOGPROBS; None records nothing): see `TokenLogprob` for the distribution.

    The engine checks only what would break it (temperature >= 0, 0 < top_p <= 1, ...). The SDK's
    settings (sdk/settings.py) are narrower, and what reaches the engine from foveal's skills and
    server is within them: temperature 0 or in [1e-6, 2], and top_p >= 2**-126 (float32's smallest
    normal number). The sampler works in float32: a top_p below that bound is 0 there, and logits
    are tempered as (logits - row max) / temperature, so that no positive temperature overflows
    them; the most likely allowed token always stays in the nucleus.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            raise ValueError("stop must be a tuple of strings, e.g. stop=('\\n',), not a bare string")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and (
            type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None (off) or an int in [0, {MAX_LOGPROBS}] (alternatives per token), "
                f"got {self.logprobs}"
            )


def seed_as_int64(seed: int) -> int:
    """An unsigned 64-bit seed as the signed int64 with the same bits (how lanes and the sampler hold it)."""
    return seed - SEED_LIMIT if seed >= SEED_LIMIT // 2 else seed


@dataclass(slots=True, frozen=True)
class PrefillInputs:
    """A prompt's inputs beyond its token ids, as the family's processor made them (tensors on the runner's device).

    image_tensors:    the family's image inputs by name (pixel_values, pixel_attention_mask, ...).
    num_image_tokens: placeholder tokens in the prompt that the image's features fill.
    image_key:        the image's content key (foveal.vision.image_key), by which the runner reuses
                      its encoding across requests; None: never cached.
    prefix_len:       tokens attended bidirectionally (PaliGemma's image + prompt prefix); 0: causal.
    image_token_id:   the placeholder id, by which the engine counts the image tokens its prefix cache
                      holds (`cached_image_tokens`); None: the prompt's pages are never shared.
    cached_image_tokens: set by the engine at launch (never by a processor): the leading image tokens
                      whose K/V came from the prefix cache. The runner scatters features only over
                      the rest, and encodes nothing when that is none.
    cache_salt:       what neither the ids nor the image say about the prompt's K/V (a LoRA variant,
                      region values embedded in the prompt): the prefix cache shares pages only
                      between prompts with the same salt. None: nothing beyond ids and image.
    """

    image_tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    num_image_tokens: int = 0
    image_key: str | None = None
    prefix_len: int = 0
    image_token_id: int | None = None
    cached_image_tokens: int = 0
    cache_salt: str | None = None


@dataclass(slots=True)
class Request:
    """One generation: prompt token ids, sampling, an optional grammar matcher, prefill inputs (images)."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    matcher: Matcher | None = None
    prefill: PrefillInputs | None = None


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One output token's log-probability, and its most likely alternatives (best first).

    The distribution is the one the token was drawn from: the model's logits with the grammar's mask
    applied, divided by the temperature, restricted by top-k / top-p (a greedy row: temperature 1,
    no filter). So a disallowed token never appears, and a token the grammar forced (jump-forward,
    or a mask that allowed one token) has logprob 0.0. `top` holds at most k (id, logprob) pairs of
    allowed tokens; fewer when fewer are allowed; empty for a token forced without a forward.
    A region value (regions.py: a coordinate or size, not a token) has logprob NaN and no `top`.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True, frozen=True)
class Timings:
    """Where one request's time went, in seconds, on the engine's clock (time.perf_counter).

    queued_s:  from submit to admission (waiting for a batch row and KV pages);
    prefill_s: from admission to the first output token's commit (the prompt's launches, chunked or
               not, and the first sample: the host learns the first token at its commit);
    decode_s:  from that commit to the finish.
    A request that ends before it is admitted, or before its first token, counts the time it had
    as queued, or as prefill: each span ends at the finish where the next never began.
    """

    queued_s: float
    prefill_s: float
    decode_s: float

    @property
    def ttft_s(self) -> float:
        """Submit to the first token: the wait and the prefill."""
        return self.queued_s + self.prefill_s

    @classmethod
    def of(cls, submitted: float, admitted: float, first_token: float, finished: float) -> Timings:
        """From the stamps (0.0 where that moment never came) and the finish time."""
        admitted = admitted or finished
        first_token = first_token or finished
        return cls(admitted - submitted, first_token - admitted, finished - first_token)


@dataclass(slots=True)
class RequestOutput:
    token_ids: list[int]  # generated tokens, without the EOS / stop token that ended them
    text: str  # decoded text, without a stop string; "" when the engine has no tokenizer
    finish_reason: FinishReason
    num_prompt_tokens: int
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when SamplingParams.logprobs is set
    timings: Timings | None = None  # set by the engine; None where an output is made by hand


class RequestHandle:
    """The caller's side of one request: iterate text deltas, `result()`, `cancel()`."""

    def __init__(self, request_id: int, cancel: Callable[[int], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._cond = threading.Condition()
        self._deltas: list[str] = []
        self._output: RequestOutput | None = None
        self._listeners: list[Callable[[str | None], None]] = []
        self._iterating = 0  # callers blocked in __iter__, waiting for a delta
        # the engine's list of committed TokenLogprobs (appended by the engine thread), or None
        self._logprobs: list[TokenLogprob] | None = None

    # engine side -------------------------------------------------------------------------------
    def _push(self, delta: str) -> None:
        with self._cond:
            self._deltas.append(delta)
            if self._iterating:
                self._cond.notify_all()
            listeners = list(self._listeners) if self._listeners else None
        if listeners:
            self._notify(listeners, delta)

    def _finish(self, output: RequestOutput) -> None:
        with self._cond:
            if self._output is not None:
                raise RuntimeError(f"request {self.request_id} finished twice")
            self._output = output
            listeners = list(self._listeners)
            self._cond.notify_all()
        self._notify(listeners, None)

    def _notify(self, listeners: list[Callable[[str | None], None]], item: str | None) -> None:
        for listener in listeners:
            try:
                listener(item)
            except Exception:  # a caller's listener (e.g. a closed event loop) must not kill the engine
                with self._cond:
                    self._listeners.remove(listener)

    # caller side -------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._output is not None

    def cancel(self) -> None:
        """Ask the engine to stop this request; its handle then finishes with CANCELLED (if not done)."""
        if not self.done:
            self._cancel(self.request_id)

    def result(self, timeout: float | None = None) -> RequestOutput:
        with self._cond:
            if not self._cond.wait_for(lambda: self._output is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
            return self._output

    def logprobs(self, start: int = 0) -> list[TokenLogprob]:
        """The logprobs of the tokens committed so far, from the `start`-th on (a copy; [] when the
        request asked for none).

        While streaming, they can run a few tokens ahead of the text deltas: a delta is held back
        while it could still be the start of a stop string or a split UTF-8 character.
        """
        return self._logprobs[start:] if self._logprobs is not None else []

    def __iter__(self) -> Iterator[str]:
        """Text deltas of committed tokens, pushed in each tick's text phase (after finalize of the next
        step): never a split UTF-8 character, never part of a stop string."""
        seen = 0
        while True:
            with self._cond:
                self._iterating += 1
                try:
                    self._cond.wait_for(
                        lambda seen=seen: len(self._deltas) > seen or self._output is not None
                    )
                finally:
                    self._iterating -= 1
                new = self._deltas[seen:]
                finished = self._output is not None  # every delta is pushed before the finish
            seen += len(new)
            yield from new
            if finished:
                return

    def _subscribe(self, listener: Callable[[str | None], None]) -> list[str]:
        """Register `listener(delta)` / `listener(None)` at the end; returns the deltas so far (and
        calls listener(None) at once if already finished)."""
        with self._cond:
            self._listeners.append(listener)
            past = list(self._deltas)
            finished = self._output is not None
        if finished:
            listener(None)
        return past
