"""The pages of sliding-window layers: a page pool of their own, in which a sequence holds only its window.

PROBLEM
    A sliding layer's query at position p reads the keys p - W + 1 .. p only (W: the window). Kept
    for every position, as a full-attention layer's must be, its K/V grows with the context although
    no query will read most of it again. But the engine reserves at admission every page a sequence
    can need (a running sequence never runs out), launches a step before the previous one is
    committed, and shares full prompt pages through the prefix cache.
SOLUTION
    A runner that declares `runner.SlidingWindow` keeps its sliding layers' K/V in a pool of its own
    (same page size; `PagePool`, prefix registry included), and each lane has a second block table
    (`Lanes.sliding_table`): entry i names the page holding positions i * P .. i * P + P - 1, or -1.
    - Launch (`advance`, called while a step is staged): each row releases the pages wholly before
      lo - W + 1, lo being its first query position in this launch, and takes pages up to its last
      query position. A released page is read by no later launch (every later query of the row is at
      or after lo, every key of the page at or before lo - W, outside the window), and a launch in
      flight that still reads it runs before the launch that can write it next (launches run in
      order on the device), so a release waits for nothing.
    - Admission (`admit`): a sequence never holds more than `hold_limit` pages (a window plus its
      longest launch: the keys one launch reads and writes), and that many are set aside for it
      (`credit`: pages it may still take), so `advance` never finds the pool empty.
    - Prefix cache: a full prompt page is registered under its chain digest (kv_cache.prefix_chain)
      when the prompt's K/V is written (`register`), or when it is released before that (a long
      prompt prefilled in chunks); a registered page that nobody holds stays findable until it is
      evicted. A new request's prefix hit of n pages (the full-attention pool's) is used only as far
      as the sliding pool still holds the pages of the window before it (`lookup` shortens n until
      it does); the pages before that window the request never needs.
INVARIANTS
    - In each launch a row's table names its own page for every position from lo - W + 1 to its last
      query position (all a sliding layer's mask leaves visible); released entries are -1 (the
      scratch page, masked).
    - A sequence holds at most `hold_limit` pages; the pages held plus the credit of all sequences
      never exceed the pool, so a page taken in `advance` is always there.
    - Every page reference is returned once: when the window passes it or at the sequence's release;
      at idle every page is free or evictable and the credit is 0.
"""

from __future__ import annotations

import numpy as np

from .kv_cache import PagePool, pages_needed
from .sequence import Sequence


class SlidingPages:
    def __init__(
        self, num_pages: int, page_size: int, window: int, prefill_chunk: int, decode_span: int, table: np.ndarray
    ) -> None:
        """`decode_span`: the most query positions a decode launch gives one row (a jump, or a
        verify step's input and drafts); `prefill_chunk`: a text prompt's tokens per launch;
        `table`: the lanes' sliding block tables (`Lanes.sliding_table`), which `advance` writes."""
        if window < 1:
            raise ValueError(f"a sliding window is >= 1 position, got {window}")
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.window = window
        self.prefill_chunk = prefill_chunk
        self.decode_span = decode_span
        self.credit = 0  # pages admitted sequences may still take
        self.table = table

    # ---- sizes ------------------------------------------------------------------------------------
    def hold_limit(self, seq: Sequence, num_cached: int) -> int:
        """The most pages `seq` ever holds, its first `num_cached` prompt tokens taken from the cache."""
        return hold_pages(
            seq.prompt_len - num_cached, seq.prompt_len + seq.max_tokens - 1, seq.request.prefill is not None,
            self.page_size, self.window, self.prefill_chunk, self.decode_span,
        )

    # ---- admission --------------------------------------------------------------------------------
    def lookup(self, chain: list[bytes], hit: int) -> tuple[int, list[int]]:
        """(n, pages): the longest prefix of n <= `hit` pages whose window the pool holds, and those
        pages (pages n - w .. n - 1, one reference each)."""
        for n in range(hit, 0, -1):
            first = self._first_needed(n * self.page_size)
            if all(self.pool.is_cached(digest) for digest in chain[first:n]):
                return n, self.pool.lookup(chain[first:n])
        return 0, []

    def admit(self, seq: Sequence, num_cached: int, cached: list[int]) -> bool:
        """Set `seq`'s pages aside (the cached window `cached` is held already); False: the pool
        cannot, and nothing is taken (the caller frees `cached`)."""
        limit = self.hold_limit(seq, num_cached)
        need = limit - len(cached)
        if self.pool.num_free - self.credit < need:
            return False
        first = num_cached // self.page_size - len(cached)
        seq.sliding = [-1] * first + cached
        seq.sliding_base = first
        seq.sliding_credit = need
        self.credit += need
        return True

    # ---- launches ---------------------------------------------------------------------------------
    def advance(self, seq: Sequence, first_query: int, last_query: int) -> None:
        """Before a launch of `seq` over positions first_query .. last_query: release the pages its
        window has passed, take those its queries write, and write both into its lane's table."""
        pages, table = seq.sliding, self.table[seq.lane]
        first = self._first_needed(first_query)
        while seq.sliding_base < first:
            index = seq.sliding_base
            page = pages[index] if index < len(pages) else -1
            if page >= 0:
                if index < len(seq.prefix_chain):  # a full prompt page: its K/V is written (see docstring)
                    self.pool.register(page, seq.prefix_chain[index])
                self.pool.free([page])
                pages[index] = table[index] = -1
                seq.sliding_credit += 1
                self.credit += 1
            seq.sliding_base += 1
        last = last_query // self.page_size
        if last >= len(pages):
            new = last + 1 - len(pages)
            if new > seq.sliding_credit:
                raise AssertionError(f"sequence {seq.id} needs {new} sliding pages past its hold limit (engine bug)")
            taken = self.pool.allocate(new)
            table[len(pages) : last + 1] = taken
            pages.extend(taken)
            seq.sliding_credit -= new
            self.credit -= new

    def register(self, seq: Sequence) -> None:
        """Offer `seq`'s full prompt pages still held to the prefix cache (their K/V is written)."""
        for index in range(seq.sliding_base, min(len(seq.sliding), len(seq.prefix_chain))):
            if seq.sliding[index] >= 0:
                self.pool.register(seq.sliding[index], seq.prefix_chain[index])

    @property
    def idle(self) -> bool:
        """Every page free or evictable and no credit out: what the pool is when no sequence holds any."""
        return self.pool.num_free == self.pool.num_pages and self.credit == 0

    def release(self, seq: Sequence) -> None:
        """Free every page `seq` still holds and return its credit (when no step in flight holds it)."""
        held = [page for page in seq.sliding[seq.sliding_base :] if page >= 0]
        self.pool.free(held)
        self.credit -= seq.sliding_credit
        seq.sliding_credit = 0
        seq.sliding = []

    def _first_needed(self, position: int) -> int:
        """The first page a query at `position` reads: the one holding position - W + 1."""
        return max(0, position - self.window + 1) // self.page_size


def span_pages(span: int, window: int, page_size: int) -> int:
    """Pages one launch of `span` query positions of a row may touch: its first query's window and its
    positions (the keys from first - window + 1 to first + span - 1, on page boundaries)."""
    return (span + window - 2) // page_size + 2


def hold_pages(
    prompt_left: int, positions: int, whole: bool, page_size: int, window: int, prefill_chunk: int, decode_span: int
) -> int:
    """The most sliding pages a sequence holds: `prompt_left` prompt tokens to compute (prefilled in
    one launch when `whole`, else in chunks), `positions` KV positions in all (prompt + max_tokens - 1)."""
    first = prompt_left if whole else min(prompt_left, prefill_chunk)
    return min(pages_needed(positions, page_size), span_pages(max(first, decode_span), window, page_size))
