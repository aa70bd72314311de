"""Continuous batching: which sequences the next launch carries, and admission under a page budget.

PROBLEM
    Every tick the next step must be formed at once: all running sequences that still need a
    token, plus as many waiting requests as fit the batch, the step's token budget and the KV pool.
    A sequence that is known to end (by max_tokens, or by a forced run that completes its grammar)
    must not get another forward, and a finished sequence may still be in a step in flight (a zombie).
SOLUTION
    `Sequence` carries the bookkeeping: `num_scheduled` (output tokens that launched steps will
    produce), `inflight_refs` (steps in flight that include it) and `finalized` (finished; its
    further tokens are dropped), and its matcher's optional capabilities, resolved when it is made
    (at submit), so that no step looks for them on the matcher. `schedule()` takes, within the
    step's token budget (`max_step_tokens`): running sequences that decode (num_scheduled <
    max_tokens, no final run pinned, no verify step in flight; one token, or a jump-forward's k;
    drafts are added by the pipeline within the room left), then the next chunk of
    running sequences still prefilling, then waiting ones in FIFO order; a request that does not
    fit the free pages waits (head of line, so a big one is not starved). Admission also gives the
    sequence a lane (lanes.py): its fixed per-step inputs, written once into host arrays.
    Chunked prefill: a text prompt is prefilled `prefill_chunk` tokens at a time at most (and no
    more than the budget the step has left), so a long prompt never stalls the decoding rows for
    a whole prompt's forward. `chunk` is the query length of its next launch; `num_prefilled`
    counts the prompt tokens whose K/V launched steps write. A chunk that does not end the
    prompt produces no token (its sample is dropped at commit). Prompts with prefill inputs
    (images, PaliGemma's bidirectional prefix) are prefilled in one launch.
INVARIANTS
    - A scheduled row's output index is `num_scheduled` before the launch; it never reaches max_tokens.
    - Pages are reserved at admission for every position the sequence can reach, so a running
      sequence never needs a page the pool does not have.
    - A step carries at most `max_step_tokens` query tokens (decode rows come first: they always fit,
      max_step_tokens >= max_batch, and jumps are capped to the room left).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .detokenizer import Detokenizer
from .drafts import Drafter
from .kv_cache import PagePool, pages_needed
from .lanes import Lanes
from .matcher import ForcedTokens, Matcher, Rollback, conforms, own_mask
from .regions import RegionSteps
from .request import FinishReason, Request, RequestHandle, TokenLogprob
from .sliding import SlidingPages


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

    def __post_init__(self) -> None:
        self.prompt_len = len(self.request.prompt_ids)
        self.max_tokens = self.request.sampling.max_tokens
        if self.request.sampling.logprobs is not None:
            self.logprobs_k = self.request.sampling.logprobs
            self.logprobs = self.handle._logprobs = []  # the handle reads what the engine appends
        matcher = self.matcher = self.request.matcher
        if matcher is None:
            return
        if conforms(matcher, ForcedTokens):
            self.forced_tokens, self.ends_after = matcher.forced_tokens, matcher.ends_after
        if conforms(matcher, RegionSteps):
            self.step_kind = matcher.step_kind
        self.own_mask = own_mask(matcher)
        if conforms(matcher, Rollback):
            self.rollback = matcher.rollback
        self.can_draft = self.step_kind is None and self.rollback is not None

    def pages_to_reserve(self, page_size: int) -> int:
        # the last output token is never fed back, so it needs no KV position
        return pages_needed(self.prompt_len + self.max_tokens - 1, page_size)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        lanes: Lanes,
        max_batch: int,
        max_step_tokens: int,
        prefill_chunk: int | None = None,
        sliding: SlidingPages | None = None,
    ) -> None:
        if lanes.count < 2 * max_batch:
            raise ValueError(f"need 2 * max_batch = {2 * max_batch} lanes, got {lanes.count}")
        self.pool = pool
        self.lanes = lanes
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk or max_step_tokens
        self.sliding = sliding  # the sliding-window layers' pages, for runners that have them
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        decoding = [s for s in self.running if s.num_prefilled == s.prompt_len]
        rows = [s for s in decoding if s.num_scheduled < s.max_tokens and not s.final_run and not s.verifying]
        tokens = len(rows) + sum(len(s.jump) - 1 for s in rows if s.jump)
        for seq in self.running:  # the next chunk of prompts still prefilling, while the budget lasts
            if seq.num_prefilled < seq.prompt_len and tokens < self.max_step_tokens and len(rows) < self.max_batch:
                tokens += self._chunk(seq, self.max_step_tokens - tokens)
                rows.append(seq)
        while self.waiting and len(rows) < self.max_batch and tokens < self.max_step_tokens:
            seq = self.waiting[0]
            pages = self._reserve(seq, self.max_step_tokens - tokens)
            if pages is None:
                break
            lane = self.lanes.take(seq.prompt_len, pages, seq.request.sampling, seq.seed, seq.sliding)
            self.waiting.popleft()  # only now: if take() raised, shutdown finds seq where remove() looks
            seq.pages, seq.lane = pages, lane
            seq.num_prefilled = seq.num_cached
            self.running.append(seq)
            rows.append(seq)
            tokens += self._chunk(seq, self.max_step_tokens - tokens)
        return rows

    def _chunk(self, seq: Sequence, step_tokens_left: int) -> int:
        """Set the query length of `seq`'s next prefill launch; returns it. A prompt with prefill
        inputs is never split (`_reserve` admitted it only if it fits whole)."""
        left = seq.prompt_len - seq.num_prefilled
        seq.chunk = left if seq.request.prefill is not None else min(left, self.prefill_chunk, step_tokens_left)
        return seq.chunk

    def _reserve(self, seq: Sequence, step_tokens_left: int) -> list[int] | None:
        """Every page `seq` can need: its cached prefix pages, shared, then fresh ones; None (nothing
        held) when the pool cannot cover the rest, or when a prompt that cannot be chunked (one with
        prefill inputs) does not fit the step's budget whole.

        At least one prompt token is always computed (its logits start the answer), so the page
        holding the last prompt token is never taken from the cache. With sliding-window pages
        (sliding.py) the hit goes only as far as their pool holds the window before it, and the
        sliding pool must be able to set the sequence's pages aside too.
        """
        page_size = self.pool.page_size
        reusable = seq.prefix_chain[: (seq.prompt_len - 1) // page_size]
        cached = self.pool.lookup(reusable) if reusable else []
        window: list[int] = []
        if self.sliding is not None and cached:
            hit, window = self.sliding.lookup(seq.prefix_chain, len(cached))
            self.pool.free(cached[hit:])
            cached = cached[:hit]
        need = seq.pages_to_reserve(page_size) - len(cached)
        whole = seq.request.prefill is not None  # images / a bidirectional prefix: one launch
        too_long = whole and seq.prompt_len - len(cached) * page_size > step_tokens_left
        num_cached = len(cached) * page_size
        admitted = not too_long and self.pool.can_allocate(need)
        if admitted and self.sliding is not None:
            admitted = self.sliding.admit(seq, num_cached, window)
        if not admitted:
            self.pool.free(cached)
            if window:
                self.sliding.pool.free(window)
            return None
        seq.num_cached = num_cached
        return cached + self.pool.allocate(need)

    def register_prefix(self, seq: Sequence) -> None:
        """Offer `seq`'s full prompt pages to the prefix cache (their K/V has been computed)."""
        for page, digest in zip(seq.pages, seq.prefix_chain, strict=False):
            self.pool.register(page, digest)
        if self.sliding is not None:
            self.sliding.register(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished sequence out of the queues (its pages are released separately)."""
        if seq.pages is None:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's pages; called exactly once, when no step in flight holds it."""
        assert seq.finalized and seq.inflight_refs == 0 and not seq.released, f"bad release of {seq.id}"
        seq.released = True
        if seq.pages is not None:
            self.pool.free(seq.pages)
            if self.sliding is not None:
                self.sliding.release(seq)
            self.lanes.give_back(seq.lane)
