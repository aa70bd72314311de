"""Keeping the engine full: images read and decoded on worker threads ahead of the engine.

PROBLEM
    The engine decodes up to `max_batch_size` sequences per step for the cost of little more than
    one, but only if that many requests are in it at once. A loop of `model.detect` calls gives it
    one at a time; and reading and decoding each image (file I/O, PNG/JPEG decode, the image key's
    hash) on the submitting thread leaves the engine waiting between requests. `Model.map` keeps a
    window of requests in flight but prepares every image on its one calling thread.
SOLUTION
    Two thread pools and a bounded window. Readers (`read_workers`, a few threads) run `read` (the
    SDK's `encode_image`: decode and key) in input order, ahead of the engine. Callers (one thread
    per request in flight, `window` threads) each wait for their image to be read, then make the
    blocking skill call; the SDK's `Model` is thread-safe and the engine batches every concurrent
    call. At most `window` items are between "read started" and "result", so memory is bounded
    and the engine always has up to `window` requests: with `window` = 2 x max_batch_size a
    request is already waiting whenever one finishes, so the batch stays at max_batch_size.
    Results are emitted in input order from a reorder buffer (`ordered=True`, what a results file
    needs), or as they complete (`ordered=False`). A slow item holds back the ordered output but
    not the engine: the window refills as any item completes, up to `window` finished items
    buffered behind the oldest.
INVARIANTS (tests/batch/test_readahead.py)
    1. Every item yields exactly one `Outcome`: its result, or the exception its read or call
       raised; one bad item never stops the others. Exceptions of a `fatal` type are raised instead.
    2. ordered=True: outcomes come in input order.
    3. At most `window` items are in flight and at most `window` finished ones are buffered.
    4. Leaving the iteration early (break, an exception, close()) cancels every item not yet
       started and returns without waiting for the calls already in the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Outcome:
    """Item `index` (its position in the input), its key, and its result or the exception it raised."""

    index: int
    key: str
    value: Any

    @property
    def failed(self) -> bool:
        return isinstance(self.value, BaseException)


def pipeline(
    items: Iterable[tuple[str, Any]],
    read: Callable[[Any], Any],
    call: Callable[[Any], Any],
    *,
    window: int,
    read_workers: int = 2,
    ordered: bool = True,
    fatal: tuple[type[BaseException], ...] = (),
) -> Iterator[Outcome]:
    """`call(read(source))` for every (key, source) of `items`, with reads ahead on worker threads."""
    if window < 1 or read_workers < 1:
        raise ValueError(f"window and read_workers must be >= 1, got {window} and {read_workers}")
    source = iter(items)
    readers = ThreadPoolExecutor(read_workers, thread_name_prefix="foveal-batch-read")
    callers = ThreadPoolExecutor(window, thread_name_prefix="foveal-batch-call")
    in_flight: dict[Future, tuple[int, str]] = {}
    finished: dict[int, Outcome] = {}  # the reorder buffer: completed, waiting for an older item
    started = emitted = 0
    exhausted = False
    try:
        while True:
            while not exhausted and len(in_flight) < window and len(finished) < window:
                pair = next(source, None)
                if pair is None:
                    exhausted = True
                    break
                image = readers.submit(read, pair[1])
                in_flight[callers.submit(_call_when_read, image, call)] = (started, pair[0])
                started += 1
            if not in_flight:
                return  # the input is exhausted and everything was emitted (the buffer drains below)
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                index, key = in_flight.pop(future)
                outcome = Outcome(index, key, _value(future))
                if isinstance(outcome.value, fatal):
                    raise outcome.value
                if ordered:
                    finished[index] = outcome
                else:
                    yield outcome
            while emitted in finished:
                yield finished.pop(emitted)
                emitted += 1
    finally:
        # Not-started reads and calls are dropped; calls already in the engine finish on their own.
        readers.shutdown(wait=False, cancel_futures=True)
        callers.shutdown(wait=False, cancel_futures=True)


def _call_when_read(image: Future, call: Callable[[Any], Any]) -> Any:
    return call(image.result())  # a failed read raises here: it becomes this item's outcome


def _value(future: Future) -> Any:
    error = future.exception()
    return error if error is not None else future.result()
