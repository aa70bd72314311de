"""Bookkeeping of the paged KV cache: which page belongs to whom (the tensors live in the runner).

PROBLEM
    Sequences come and go every tick; a finished sequence may still be read by a step in flight
    (a zombie), so its pages must outlive its finish, and must be freed exactly once.
SOLUTION
    A free list of page ids. A sequence reserves every page it can ever need at admission
    (prompt + max_tokens - 1 positions), so a running sequence never runs out mid-flight; when the
    pool cannot cover a new request, the request waits in the queue (admission control).
INVARIANTS
    - A page is owned by at most one sequence; freeing a page that is free raises.
    - At idle (no sequence, no step in flight) every page is free.
"""

from __future__ import annotations


def pages_needed(num_positions: int, page_size: int) -> int:
    return -(-num_positions // page_size)


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._is_free = [True] * num_pages
        self.frees = 0  # pages returned, for leak checks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"page pool exhausted: asked {n}, {len(self._free)} free (check can_allocate first)"
            )
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = True
            self._free.append(p)
        self.frees += len(pages)
