"""Continuous batching: which sequences the next launch carries, and admission under a page budget.

PROBLEM
    Every tick the next step must be formed at once: all running sequences that still need a
    token, plus as many waiting requests as fit the batch, the step's token budget and the KV pool.
    A sequence that is known to end (by max_tokens, or by a forced run that completes its grammar)
    must not get another forward, and a finished sequence may still be in a step in flight (a zombie).
SOLUTION
    `Sequence` (sequence.py) carries the bookkeeping: `num_scheduled` (output tokens that launched steps will
    produce), `inflight_refs` (steps in flight that include it) and `finalized` (finished; its
    further tokens are dropped), and its matcher's optional capabilities, resolved when it is made
    (at submit), so that no step looks for them on the matcher. `schedule()` takes, within the
    step's token budget (`max_step_tokens`): running sequences that decode (num_scheduled <
    max_tokens, no final run pinned, no verify step in flight; one token, or a jump-forward's k;
    drafts are added by the pipeline within the room left), then the next chunk of
    running sequences still prefilling, then waiting ones in FIFO order; a request that does not
    fit the free pages waits (head of line, so a big one is not starved). Admission also gives the
    sequence a lane (lanes.py): its fixed per-step inputs, written once into host arrays.
    Shared prefixes wait for their first writer: a waiting request whose prompt starts with at least
    SHARE_PAGES more full pages than the prefix cache holds, pages that a running sequence's prefill
    is writing now (its prompt's page hashes, not yet registered), is admitted only once that
    sequence has registered them, so that it reads them from the cache instead of computing them
    a second time in the same launch (requests arriving together with one system prompt, or asking
    about one image, prefill it once).
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
    - A request waits for a sharer only while that sharer runs and has committed no token (it
      registers its pages at its first commit), so every wait ends within its prefill.
    - A step carries at most `max_step_tokens` query tokens (decode rows come first: they always fit,
      max_step_tokens >= max_batch, and jumps are capped to the room left).
"""

from __future__ import annotations

import time
from collections import deque

from .kv_cache import PagePool
from .lanes import Lanes
from .sequence import Sequence
from .sliding import SlidingPages

SHARE_PAGES = 2  # a shared run of pages worth a step's wait (a page is DEFAULT_PAGE_SIZE tokens)


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
        writing: set[bytes] | None = None  # page hashes the running prefills write, made when needed
        while self.waiting and len(rows) < self.max_batch and tokens < self.max_step_tokens:
            seq = self.waiting[0]
            if seq.prefix_chain:
                writing = self._being_written() if writing is None else writing
                if self._shares_a_prefill(seq, writing):
                    break  # FIFO: the requests behind it wait too
            pages = self._reserve(seq, self.max_step_tokens - tokens)
            if pages is None:
                break
            lane = self.lanes.take(seq.prompt_len, pages, seq.request.sampling, seq.seed, seq.sliding)
            self.waiting.popleft()  # only now: if take() raised, shutdown finds seq where remove() looks
            seq.pages, seq.lane = pages, lane
            seq.admitted_s = time.perf_counter()  # its queued time ends, its prefill begins (Timings)
            seq.num_prefilled = seq.num_cached
            self.running.append(seq)
            rows.append(seq)
            tokens += self._chunk(seq, self.max_step_tokens - tokens)
            if writing is not None:
                writing.update(seq.prefix_chain)
        return rows

    def _being_written(self) -> set[bytes]:
        """The page hashes of running sequences whose prompt pages are not registered yet."""
        return {d for s in self.running if s.num_committed == 0 and not s.finalized for d in s.prefix_chain}

    def _shares_a_prefill(self, seq: Sequence, writing: set[bytes]) -> bool:
        """Whether `seq` would compute SHARE_PAGES or more pages a running prefill is writing."""
        reusable = seq.prefix_chain[: (seq.prompt_len - 1) // self.pool.page_size]
        cached = 0
        while cached < len(reusable) and self.pool.is_cached(reusable[cached]):
            cached += 1
        shared = cached
        while shared < len(reusable) and reusable[shared] in writing:  # a hash chain: prefixes agree
            shared += 1
        return shared - cached >= SHARE_PAGES

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
