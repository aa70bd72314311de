"""A decoded-pixel budget: how many pixels of decoded images a model holds at once, across threads.

PROBLEM
    Encoded size says little about decoded size: a 777 KB near-uniform JPEG decodes to 7000x7000
    pixels (~200 MB in PIL, twice that while converting). The body limit and the per-image pixel
    limit both pass it, and sixteen such calls decoding at once take gigabytes that nothing bounds.

SOLUTION
    One `PixelBudget` per model (no global state) counts the pixels of images being decoded and
    preprocessed. A caller reserves an image's `decode_pixels` (from `open_image`, read off the
    header) before decoding, shrinks the reservation to the decoded size once decoding is done,
    and gives it back when the decoded image is no longer needed (after the model's processor has
    made its tensors). `PixelBudget.load` does the whole sequence as one context manager.
    Reservations are granted first come, first served: a caller waits while the pixels in use plus
    its own would pass the budget, or while an earlier caller waits; after `timeout_s` it raises
    `PixelBudgetTimeout` (a server answers 429 with Retry-After). An image larger than the whole
    budget is granted when nothing else is held, and runs alone.

INVARIANTS (tests/vision/test_budget.py)
    1. The pixels held never exceed `max_pixels`, except by one image granted alone.
    2. Every grant is given back exactly once: on leaving its `with` block, on any exception (in
       the body, the decode, the wait itself), or by `release()`, which is idempotent.
    3. Grants follow arrival order: a large request is never overtaken by later small ones.
    4. No wait is unbounded: every acquire ends granted or with `PixelBudgetTimeout` within its
       timeout, and a waiter that gives up leaves the queue, so the next one can go.
    Do not acquire from a thread that already holds a grant on the same budget (a nested acquire
    can only time out while the outer grant waits for it); acquire outside other locks.

What a pixel costs: PIL keeps 4 bytes per RGB pixel, and converting holds a source and its RGB copy,
so a budget of N pixels bounds image memory to about 4-8 N bytes.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from PIL import Image

from .images import open_image

DEFAULT_PIXEL_BUDGET = 100_000_000  # two images of images.DEFAULT_MAX_PIXELS at once: ~0.4-0.8 GB
DEFAULT_TIMEOUT_S = 10.0


class PixelBudgetTimeout(Exception):
    """The budget stayed full for the whole wait: retry later (HTTP 429), or give the model a larger budget.

    Not a ValueError: the image is fine, the model is busy.
    """

    def __init__(self, pixels: int, max_pixels: int, in_use: int, waited_s: float) -> None:
        super().__init__(
            f"decoding this image needs {pixels:,} pixels of the model's decoded-pixel budget of "
            f"{max_pixels:,}, and other images held {in_use:,} of it for the whole {waited_s:.1f} s wait; "
            "retry later, or give the model a larger PixelBudget (max_pixels) or a longer timeout_s"
        )
        self.pixels = pixels
        self.max_pixels = max_pixels
        self.in_use = in_use
        self.waited_s = waited_s


class PixelLease:
    """Pixels granted by a `PixelBudget`; give them back with `release()` or by leaving `with`."""

    __slots__ = ("_budget", "pixels")

    def __init__(self, budget: PixelBudget, pixels: int) -> None:
        self._budget: PixelBudget | None = budget
        self.pixels = pixels

    @property
    def released(self) -> bool:
        return self._budget is None

    def shrink(self, pixels: int) -> None:
        """Keep only `pixels` of the grant (say, once a decode is done, the decoded image's count)."""
        _check_count(pixels, "pixels")
        if self._budget is not None and pixels < self.pixels:
            self._budget._give_back(self.pixels - pixels)
            self.pixels = pixels

    def release(self) -> None:
        """Give the whole grant back; a second call does nothing."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.pixels)
            self.pixels = 0

    def __enter__(self) -> PixelLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PixelBudget:
    """At most `max_pixels` decoded pixels held at once by the callers that share it (thread-safe).

    `timeout_s`: how long `acquire` waits by default before raising `PixelBudgetTimeout`.
    """

    def __init__(
        self, max_pixels: int = DEFAULT_PIXEL_BUDGET, *, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        _check_count(max_pixels, "max_pixels", positive=True)
        self.max_pixels = max_pixels
        self.timeout_s = _check_timeout(timeout_s)
        self._changed = threading.Condition(threading.Lock())
        self._queue: deque[object] = deque()  # one ticket per waiting caller, in arrival order
        self._in_use = 0
        self._peak = 0
        self._timeouts = 0

    @property
    def in_use(self) -> int:
        """Pixels granted and not yet given back."""
        return self._in_use

    @property
    def waiting(self) -> int:
        """Callers waiting for pixels now."""
        return len(self._queue)

    def stats(self) -> dict[str, int]:
        """Counters for metrics: pixels in use, the most ever in use, callers waiting, timeouts so far."""
        with self._changed:
            return {
                "max_pixels": self.max_pixels,
                "in_use": self._in_use,
                "peak": self._peak,
                "waiting": len(self._queue),
                "timeouts": self._timeouts,
            }

    def acquire(self, pixels: int, timeout_s: float | None = None) -> PixelLease:
        """Wait (at most `timeout_s`, default the budget's) until `pixels` fit; the grant, to release.

        Raises `PixelBudgetTimeout` when the wait ends first; nothing is held then.
        """
        _check_count(pixels, "pixels")
        wait_s = self.timeout_s if timeout_s is None else _check_timeout(timeout_s)
        start = time.monotonic()
        ticket = object()
        with self._changed:
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self._fits(pixels)):
                    left = start + wait_s - time.monotonic()
                    if left <= 0:
                        self._timeouts += 1
                        raise PixelBudgetTimeout(pixels, self.max_pixels, self._in_use, wait_s)
                    self._changed.wait(left)
            finally:
                # Granted or not (timeout, KeyboardInterrupt), the ticket leaves the queue, and the
                # caller behind it may now be first and fit.
                self._queue.remove(ticket)
                self._changed.notify_all()
            self._in_use += pixels
            self._peak = max(self._peak, self._in_use)
        return PixelLease(self, pixels)

    def hold(self, pixels: int, timeout_s: float | None = None) -> PixelLease:
        """`acquire`, spelled for `with budget.hold(n):` (the lease is its own context manager)."""
        return self.acquire(pixels, timeout_s)

    @contextlib.contextmanager
    def load(
        self,
        image: Any,
        *,
        min_size: tuple[int, int] | None = None,
        max_pixels: int | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[Image.Image]:
        """`load_image(image, min_size=, max_pixels=)` within the budget, held until the `with` block ends.

        The header is read and checked first (ImageError before any wait), then the decode's
        pixels are reserved, the image decoded, and the reservation shrunk to the decoded image.
        Keep the block around everything that needs the decoded pixels (the model's processor).
        """
        with contextlib.ExitStack() as stack:
            with open_image(image, max_pixels=max_pixels, min_size=min_size) as opened:
                lease = stack.enter_context(self.acquire(opened.decode_pixels, timeout_s))
                decoded = opened.decode()
            lease.shrink(decoded.width * decoded.height)
            yield decoded

    def _fits(self, pixels: int) -> bool:
        # An image larger than the budget is granted once nothing else is held: it runs alone.
        return self._in_use + pixels <= self.max_pixels or self._in_use == 0

    def _give_back(self, pixels: int) -> None:
        with self._changed:
            self._in_use -= pixels
            self._changed.notify_all()


def _check_count(value: Any, name: str, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise ValueError(
            f"{name} must be an int >= {1 if positive else 0} (a count of pixels), got {value!r}"
        )


def _check_timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"timeout_s must be a finite number of seconds >= 0 (0: do not wait), got {value!r}; "
            "waits are bounded so that a full budget can never hang a caller"
        )
    return float(value)


__all__ = [
    "DEFAULT_PIXEL_BUDGET",
    "DEFAULT_TIMEOUT_S",
    "PixelBudget",
    "PixelBudgetTimeout",
    "PixelLease",
]
