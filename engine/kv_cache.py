"""Bookkeeping of the paged KV cache: which page belongs to whom, and which full pages can be shared
(the tensors live in the runner).

PROBLEM
    Sequences come and go every tick; a finished sequence may still be read by a step in flight
    (a zombie), so its pages must outlive its finish, and must be freed exactly once. And many
    requests start with the same tokens (a chat template, a system prompt, one document asked many
    questions): computing their K/V again is work the cache could skip.
SOLUTION
    A free list of page ids with a reference count per page. A sequence reserves every page it can
    ever need at admission (prompt + max_tokens - 1 positions), so a running sequence never runs
    out mid-flight; when the pool cannot cover a new request, the request waits in the queue
    (admission control). Full prompt pages are content-addressed (prefix cache): once its K/V is
    written, a page is `register`ed under a hash chained over the tokens of every page up to it,
    and a new request `lookup`s its own chain and shares the longest run of cached pages (one more
    reference each). A cached page nobody references is not freed but kept, least recently used
    first in line for eviction when the free list runs out.
INVARIANTS
    - A page's reference count is the number of sequences holding it; freeing below 0 raises.
    - A page with references is never evicted or handed out again; a registered page's content
      never changes (only full prompt pages are registered; writes go to pages past them).
    - At idle (no sequence, no step in flight) every page is free or evictable: `num_free` is
      `num_pages`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .request import PrefillInputs

DEFAULT_PAGE_SIZE = 16  # tokens a KV page holds unless EngineConfig says otherwise


def pages_needed(num_positions: int, page_size: int) -> int:
    return -(-num_positions // page_size)


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages
        self._page_of: dict[bytes, int] = {}  # prefix-chain hash -> cached page
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.frees = 0  # page references returned, for leak checks

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"page pool exhausted: asked {n}, {self.num_free} free (check can_allocate first)")
        while len(self._free) < n:  # the least recently used cached pages make room
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
            self._free.append(page)
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if self._refs[page] == 0:
                raise RuntimeError(f"page {page} freed twice")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        self.frees += len(pages)

    def lookup(self, chain: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `chain`, each with one more reference."""
        pages = []
        for digest in chain:
            page = self._page_of.get(digest)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
        return pages

    def is_cached(self, digest: bytes) -> bool:
        """Whether a page is registered under `digest` (held or evictable); takes no reference."""
        return digest in self._page_of

    def register(self, page: int, digest: bytes) -> None:
        """Make a held page, whose K/V is written, findable by `digest` (first come, first kept)."""
        if self._refs[page] == 0:
            raise RuntimeError(f"page {page} is not held; only a sequence's own pages can be registered")
        if digest not in self._page_of and page not in self._hash_of:
            self._page_of[digest] = page
            self._hash_of[page] = digest


def prefix_chain(token_ids: list[int], page_size: int, seed: bytes = b"") -> list[bytes]:
    """The hash of each full page of `token_ids`, chained: page i's digest covers `seed` and pages 0..i.

    `seed` (`prefix_seed`) carries what the token ids do not say about the K/V: which image fills the
    placeholder tokens, and for a bidirectional prefix the tokens after the page.
    """
    digests, previous = [], seed
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = array("q", token_ids[start : start + page_size]).tobytes()
        previous = hashlib.blake2b(previous + page, digest_size=16).digest()
        digests.append(previous)
    return digests


def prefix_seed(token_ids: list[int], prefill: PrefillInputs | None) -> bytes | None:
    """The seed of a prompt's page chain, or None when its pages must never be shared.

    Text only: an empty seed (pages shared by their ids). With an image: its content key, so that pages are shared only between
    prompts of the same image (all of a prompt's pages, those before the image too: simpler, and
    in every supported template the image comes first or after a few tokens). An image without a
    key, or without the placeholder id by which the engine counts its cached tokens, is never shared. A bidirectional prefix (PaliGemma's image + prompt, Moondream's BOS +
    image) makes a page's K/V depend on the prefix tokens after it, so its seed also covers the
    whole prefix: such pages are shared only between prompts with the same image and prefix.
    A `cache_salt` (a LoRA variant, region values in the prompt) is folded in last, text-only
    prompts included: pages are shared only between prompts with the same salt.
    """
    if prefill is None or not prefill.num_image_tokens:
        seed = b""
    elif prefill.image_key is None or prefill.image_token_id is None:
        return None
    else:
        seed = hashlib.blake2b(prefill.image_key.encode(), digest_size=16).digest()
    if prefill is not None and prefill.prefix_len:
        prefix = array("q", token_ids[: prefill.prefix_len]).tobytes()
        seed = hashlib.blake2b(seed + prefix, digest_size=16).digest()
    if prefill is not None and prefill.cache_salt is not None:
        seed = hashlib.blake2b(seed + b"salt:" + prefill.cache_salt.encode(), digest_size=16).digest()
    return seed
