"""`Sequence`: one request's state inside the engine, from submit to release.

The scheduler admits and schedules it (scheduler.py), the pipeline launches, commits and finalizes
it (pipeline.py, step.py), `Sequences` ends it (sequences.py), the sliding-window pool holds its
window (sliding.py): each of them imports it from here, so none of them imports another for it.
Its matcher's optional capabilities are resolved once, when it is made (at submit), so that no step
looks for them on the matcher.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .detokenizer import Detokenizer
from .drafts import Drafter
from .kv_cache import pages_needed
from .matcher import ForcedTokens, Matcher, Rollback, conforms, own_mask
from .regions import RegionSteps
from .request import FinishReason, Request, RequestHandle, TokenLogprob


@dataclass(slots=True, eq=False)
class Sequence:
    id: int
    request: Request
    handle: RequestHandle
    seed: int
    stop_ids: frozenset[int]
    detok: Detokenizer
    # copies of request fields the hot paths read every step (attributes, not property calls)
    prompt_len: int = field(init=False, default=0)
    max_tokens: int = field(init=False, default=0)
    matcher: Matcher | None = field(init=False, default=None)
    # the matcher's optional capabilities, resolved once here (matcher.py, regions.py): the step loop
    # calls these bound methods or reads the flag, and never looks for them on the matcher
    forced_tokens: Callable[[], list[int]] | None = field(init=False, default=None)  # ForcedTokens
    ends_after: Callable[[list[int]], bool] | None = field(init=False, default=None)  # ForcedTokens
    step_kind: Callable[[], int] | None = field(init=False, default=None)  # RegionSteps
    own_mask: bool = field(init=False, default=False)  # OwnMask: the pipeline fills its rows itself
    rollback: Callable[[int], None] | None = field(init=False, default=None)  # Rollback
    can_draft: bool = field(init=False, default=True)  # no region steps; no matcher, or one with Rollback
    pages: list[int] | None = None
    # its sliding-window layers' pages by page index, -1 where not held (sliding.py; empty without them)
    sliding: list[int] = field(default_factory=list)
    sliding_base: int = 0  # pages before it are released
    sliding_credit: int = 0  # sliding pages it may still take
    lane: int = -1  # its row in the Lanes arrays, from admission to release
    token_ids: list[int] = field(default_factory=list)
    num_committed: int = 0  # output tokens committed (including a final EOS / stop token)
    num_scheduled: int = 0
    inflight_refs: int = 0
    finalized: bool = False
    released: bool = False
    finish_reason: FinishReason | None = None
    prefix_chain: list[bytes] = field(default_factory=list)  # hashes of its full prompt pages (kv_cache)
    num_cached: int = 0  # prompt tokens whose K/V came from the prefix cache (prefill skips them)
    num_prefilled: int = 0  # prompt tokens whose K/V launched steps write (or the cache held)
    chunk: int = 0  # while prefilling: the query length of its next launch (set by schedule())
    # forced tokens pinned at finalize (pipeline.py, jump-forward) that the next launch carries as its query
    jump: list[int] | None = None
    final_run: bool = False  # its pinned forced tokens complete the output: no launch after them (pipeline.py)
    # speculative decoding (pipeline.py): its drafts and back-off, made at its first draft; and
    # whether a verify step of it is in flight, which the next launch cannot plan for (it sits out)
    drafter: Drafter | None = None
    verifying: bool = False
    logprobs_k: int = field(init=False, default=-1)  # SamplingParams.logprobs; -1: none recorded
    logprobs: list[TokenLogprob] | None = field(init=False, default=None)  # one per token_ids entry
    # when it was submitted, admitted (scheduler.py) and its first token committed (sequences.py), on
    # time.perf_counter; 0.0 until then. Its output's Timings are made from them at the finish.
    submitted_s: float = field(init=False, default=0.0)
    admitted_s: float = 0.0
    first_token_s: float = 0.0

    def __post_init__(self) -> None:
        self.submitted_s = time.perf_counter()  # made at submit, on the caller's thread
        self.prompt_len = len(self.request.prompt_ids)
        self.max_tokens = self.request.sampling.max_tokens
        if self.request.sampling.logprobs is not None:
            self.logprobs_k = self.request.sampling.logprobs
            self.logprobs = self.handle._logprobs = []  # the handle reads what the engine appends
        matcher = self.matcher = self.request.matcher
        if matcher is None:
            return
        self.own_mask = own_mask(matcher)
        if conforms(matcher, ForcedTokens):
            self.forced_tokens, self.ends_after = matcher.forced_tokens, matcher.ends_after
        if conforms(matcher, RegionSteps):
            self.step_kind = matcher.step_kind
        if conforms(matcher, Rollback):
            self.rollback = matcher.rollback
        self.can_draft = self.step_kind is None and self.rollback is not None

    def pages_to_reserve(self, page_size: int) -> int:
        # the last output token is never fed back, so it needs no KV position
        return pages_needed(self.prompt_len + self.max_tokens - 1, page_size)
