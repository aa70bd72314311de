"""`Engine`: the thread and inbox shell around the pipeline.

PROBLEM
    Callers on any thread submit and cancel requests and wait on their handles, while one
    scheduler thread must own every piece of pipeline state (no locks on the hot path) and must
    never hang a caller: not on shutdown with steps in flight, not when the runner fails.
SOLUTION
    `submit` and `cancel` only append to an inbox under a condition variable. The scheduler thread
    (`_loop`) moves the inbox into the `Pipeline` and calls `pipeline.tick()` while there is work
    (pipeline.py: launch t+1, commit t, finalize t+1, text), and sleeps on the condition otherwise.
    `close()` stops the loop; whatever is left is finished CANCELLED (ERROR after a runner or device
    failure) and the steps in flight are drained, so every handle ends and every page comes back.
    What the engine calls on its runner and on a request's matcher is declared as protocols
    (runner.py, matcher.py, regions.py) and checked once: the runner when the Engine is built, a
    matcher by `submit`; an object that lacks a required method is refused there with a TypeError
    naming it, and the optional capabilities found are kept, never looked for again.
INVARIANTS
    - Only the scheduler thread touches the pipeline; other threads touch only the inbox.
    - Every handle ends: finished, cancelled, failed, or cancelled by close().
    - A request the engine can never run is refused by `submit` before it is queued (limits.py,
      and `Matcher` for its matcher); a runner that does not implement `ModelRunner` is refused
      by the constructor, before anything is sized or allocated.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable

from . import limits, shutdown, switch
from .config import EngineConfig
from .detokenizer import Detokenizer
from .device import make_device
from .drafts import DraftStats
from .kv_cache import PagePool, prefix_chain, prefix_seed
from .lanes import Lanes
from .matcher import Matcher, conforms, require
from .pipeline import Pipeline
from .request import FinishReason, Request, RequestHandle, RequestOutput, seed_as_int64
from .runner import ModelRunner, Quiesce, sliding_window
from .sequence import Sequence
from .slot import DecodeSlot
from .trace import Trace


class Engine:
    def __init__(
        self, runner: ModelRunner, tokenizer: object = None, config: EngineConfig | None = None
    ) -> None:
        require(runner, ModelRunner, "runner", "foveal.engine.runner.ModelRunner")
        self.config = config = limits.resolve(config or EngineConfig(), runner)
        self.runner = runner
        self._window = sliding_window(runner)
        self._quiesce = runner.quiesce if conforms(runner, Quiesce) else None
        self.tokenizer = tokenizer
        self.trace = Trace(config.trace)
        self.device = make_device(runner.device, self.trace)
        self.pipeline = Pipeline(
            runner,
            self.device,
            pipelined=config.pipelined,
            max_batch=config.max_batch,
            max_step_tokens=config.max_step_tokens,
            prefill_chunk=config.prefill_chunk,
            sliding_pages=config.sliding_pages,
            page_size=config.page_size,
            num_pages=config.num_pages,
            max_model_len=config.max_model_len,
            fill_masks=config.fill_masks,
            jump_forward=config.jump_forward,
            speculative=config.speculative,
            decode_burst=config.decode_burst,
            debug=config.debug,
            debug_hook=config.debug_hook,
            trace=self.trace,
        )
        self._next_id = 0
        self._seed_rng = random.Random(config.seed)
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cancels: list[int] = []
        self._closing = False
        self._error: BaseException | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._switch_held = config.switch_interval is not None
        if self._switch_held:
            switch.acquire(config.switch_interval)
        self._thread = threading.Thread(target=self._loop, name="foveal-engine", daemon=True)
        self._thread.start()
        shutdown.register(self)  # closed at interpreter exit if still open (engine/shutdown.py)

    # the pipeline's pools, for callers that check them (tests, benchmarks)
    @property
    def slots(self) -> list[DecodeSlot]:
        return self.pipeline.slots

    @property
    def lanes(self) -> Lanes:
        return self.pipeline.lanes

    @property
    def pool(self) -> PagePool:
        return self.pipeline.pool

    # ---- public API ---------------------------------------------------------------------------
    def submit(self, request: Request) -> RequestHandle:
        """Queue a request (thread-safe); raises ValueError for a request the engine can never run,
        TypeError for a matcher that does not implement `Matcher`."""
        if request.matcher is not None:
            require(request.matcher, Matcher, "matcher", "foveal.engine.matcher.Matcher")
        limits.check_request(request, self.config, self.runner.vocab_size, self.tokenizer, self._window)
        seed = prefix_seed(request.prompt_ids, request.prefill) if self.config.prefix_cache else None
        chain = [] if seed is None else prefix_chain(request.prompt_ids, self.config.page_size, seed)
        with self._cond:
            if self._closing or self._error is not None:
                raise RuntimeError("engine is closed or failed; create a new Engine")
            request_id = self._next_id
            self._next_id += 1
            seed = request.sampling.seed
            if seed is None:
                seed = self._seed_rng.getrandbits(32)
            handle = RequestHandle(request_id, self.cancel)
            stop_ids = set(request.sampling.stop_token_ids)
            if not request.sampling.ignore_eos:
                stop_ids |= set(self.config.eos_token_ids)
            detok = Detokenizer(self.tokenizer, request.sampling.stop, request.sampling.skip_special_tokens)
            seq = Sequence(request_id, request, handle, seed_as_int64(seed), frozenset(stop_ids), detok)
            seq.prefix_chain = chain
            self._inbox.append(seq)
            self._idle.clear()
            self._cond.notify_all()
        return handle

    def generate(self, requests: Iterable[Request], timeout: float | None = None) -> list[RequestOutput]:
        handles = [self.submit(r) for r in requests]
        return [h.result(timeout) for h in handles]

    def cancel(self, request_id: int) -> None:
        with self._cond:
            self._cancels.append(request_id)
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is queued or running and no step is in flight."""
        return self._idle.wait(timeout)

    def stats(self) -> dict:
        device = self.device
        summary = self.pipeline.stats.summary(device.busy_s, dict(device.job_s), dict(device.job_n))
        summary["speculative"] = self.pipeline.draft_stats.summary()
        chooser = getattr(device, "chooser", None)  # CPU: the thread count its small launches are timed on
        if self.pipeline.own_threads is not None:  # the runner's own pool runs every launch (runner.OwnThreads)
            summary["decode_threads"] = self.pipeline.own_threads
        elif chooser is not None:
            summary["decode_threads"] = chooser.choice
        return summary

    def reset_stats(self) -> None:
        self.pipeline.stats.reset()
        self.pipeline.draft_stats = DraftStats()
        self.device.busy_s = 0.0
        self.device.job_s.clear()
        self.device.job_n.clear()

    def free_pages(self) -> int:
        return self.pipeline.pool.num_free

    def close(self) -> None:
        """Stop the engine: unfinished requests end CANCELLED, steps in flight are drained."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self.device.close()
        if self._quiesce is not None:  # a runner with work of its own (background traces)
            self._quiesce()
        if self._switch_held:  # close() may be called twice
            self._switch_held = False
            switch.release(self.config.switch_interval)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the scheduler thread -----------------------------------------------------------------
    def _loop(self) -> None:
        pipeline = self.pipeline
        try:
            while self._wait_for_work():
                self._gather_arrivals()
                self._take_inbox()
                started = time.perf_counter()
                pipeline.tick()
                pipeline.stats.active_s += time.perf_counter() - started
                with self._cond:  # under the lock: a concurrent submit clears the flag after this
                    if not pipeline.has_work() and not self._inbox:
                        self._idle.set()
        except BaseException as error:  # a runner or device failure: fail every request, never hang
            self._error = error
        self._take_inbox()
        if self._error is None:
            pipeline.drain(FinishReason.CANCELLED)
        else:
            pipeline.drain(FinishReason.ERROR, repr(self._error))
        self._idle.set()

    def _wait_for_work(self) -> bool:
        """Sleep until there is something to do; False when the engine is closing."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._inbox or self._cancels or self._closing or self.pipeline.has_work()
            )
            return not self._closing

    def _gather_arrivals(self) -> None:
        """On an idle pipeline, let requests that arrive together join one prefill launch: wait while
        they keep coming (a quiet `admission_window_s` ends it, and so does a full batch)."""
        window = self.config.admission_window_s
        if window <= 0 or self.pipeline.has_work():
            return
        give_up = time.perf_counter() + 4 * window
        with self._cond:
            arrived = len(self._inbox)
            while arrived < self.config.max_batch and not (self._closing or self._cancels):
                quiet_until = min(time.perf_counter() + window, give_up)
                self._cond.wait_for(
                    lambda arrived=arrived: len(self._inbox) > arrived or self._closing,
                    timeout=max(quiet_until - time.perf_counter(), 0),
                )
                if len(self._inbox) == arrived or time.perf_counter() >= give_up:
                    return
                arrived = len(self._inbox)

    def _take_inbox(self) -> None:
        """Move new requests and cancels into the pipeline."""
        with self._cond:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for seq in new:
            self.pipeline.sequences.add(seq)
        for request_id in cancels:
            self.pipeline.sequences.cancel(request_id)
