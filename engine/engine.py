"""The engine: a scheduler thread running the two-slot pipeline (launch / commit / finalize).

PROBLEM
    The accelerator must never wait for Python bookkeeping (appending tokens, advancing grammar
    matchers, detokenizing, stop checks), and constrained decoding must run ahead like
    unconstrained decoding does.
SOLUTION
    Each tick (DESIGN.md "The engine"):
      1. launch step t+1 into the free DecodeSlot: its decode rows' input ids are gathered on the
         device from where step t's sampler wrote them;
      2. commit step t (oldest first): wait for its host copy, read it, free its slot, append
         tokens, advance matchers, detect the stops that need no text (EOS and stop ids, grammar
         end, max_tokens);
      3. finalize step t+1: fill the masks from the just-advanced matchers, queue the sampler and
         the host copy;
      4. text of step t: detokenize, find stop strings, stream deltas.
    The device runs forward t+1 while the host commits t. Sample t+1 waits for commit t and
    finalize t+1, so those two must fit inside forward t+1; launch and text need only fit in the
    whole step, which is why text comes last (a sequence a stop string ends at t has had a mask
    filled for t+1; it rides in t+1 as a zombie either way). Blocking mode (`pipelined=False`) is the
    same tick with waits: for the forward before finalize, and for the step's ids right after it
    (commit), so nothing overlaps: the baseline of comparisons. A sequence that finishes at commit t may
    ride in step t+1 as a zombie: its token there is dropped, its pages wait for inflight_refs 0.
INVARIANTS (tests/engine/ has a test for each)
    1. Greedy or seeded outputs are token-identical in pipelined and blocking mode.
    2. Nothing is emitted after a stop; a zombie's token is dropped.
    3. Step t+1's mask comes from the matcher after committing t.
    4. Every page and slot is freed exactly once, after inflight_refs is 0; at idle the pools are full.
    5. A slot's host buffers are never overwritten before commit has read them.
    6. Cancel, finish and admission in one step, shutdown with steps in flight: no hang, no leak.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import switch
from .detokenizer import Detokenizer
from .device import make_device
from .kv_cache import PagePool, pages_needed
from .lanes import Lanes
from .matcher import FillMasks, bitmask_words, fill_masks_each
from .request import FinishReason, Request, RequestHandle, RequestOutput
from .runner import ForwardBatch, ModelRunner
from .sampler import SamplingBatch, sample
from .scheduler import Scheduler, Sequence
from .slot import POISON, DecodeSlot, SlotState
from .stats import Stats
from .trace import Trace


@dataclass(slots=True)
class EngineConfig:
    pipelined: bool = True
    max_batch: int = 64  # rows per step
    max_step_tokens: int = 2048  # query tokens per step (prefill prompts + one per decode row)
    page_size: int = 16
    num_pages: int = 1024
    max_model_len: int = 2048  # prompt + output tokens of one sequence
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # draws the seeds of requests that give none
    fill_masks: FillMasks = fill_masks_each  # pass foveal.grammars.fill_masks for one native call
    debug: bool = False  # poison host buffers after reading them; check slot states
    debug_hook: Callable[[str], None] | None = None  # called at each phase (tests inject delays)
    trace: bool = False
    switch_interval: float | None = 1e-4  # GIL hand-off interval while the engine runs


@dataclass(slots=True, eq=False)
class Step:
    number: int
    slot: DecodeSlot
    rows: list[Sequence]
    lane: np.ndarray | None = None  # each row's lane
    num_tokens: int = 0
    num_decode: int = 0
    table_width: int = 0
    max_query_len: int = 0
    max_context_len: int = 0
    extras: list[Any] | None = None


class Engine:
    def __init__(
        self, runner: ModelRunner, tokenizer: Any = None, config: EngineConfig | None = None
    ) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.max_step_tokens < cfg.max_batch:
            raise ValueError("max_step_tokens must be >= max_batch (each decode row is one token)")
        self.runner = runner
        self.tokenizer = tokenizer
        self.trace = Trace(cfg.trace)
        self.device = make_device(runner.device, self.trace)
        self.pool = PagePool(cfg.num_pages, cfg.page_size)
        runner.allocate_kv(cfg.num_pages, cfg.page_size)
        max_pages = pages_needed(cfg.max_model_len, cfg.page_size)
        self.lanes = Lanes(2 * cfg.max_batch, max_pages)
        self.scheduler = Scheduler(self.pool, self.lanes, cfg.max_batch, cfg.max_step_tokens)
        self._arange = np.arange(cfg.max_batch + 1)  # row numbers, for steps of one query token per row
        words = bitmask_words(runner.vocab_size)
        self.slots = [
            DecodeSlot(i, self.device, cfg.max_batch, cfg.max_step_tokens, max_pages, words) for i in range(2)
        ]
        self._stats = Stats()
        self._inflight: deque[Step] = deque()
        self._step_no = 0
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0
        self._seed_rng = random.Random(cfg.seed)
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._cancels: list[int] = []
        self._closing = False
        self._error: BaseException | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._switch_held = cfg.switch_interval is not None
        if self._switch_held:
            switch.acquire(cfg.switch_interval)
        self._thread = threading.Thread(target=self._loop, name="foveal-engine", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------------
    def submit(self, request: Request) -> RequestHandle:
        """Queue a request (thread-safe); raises ValueError for a request the engine can never run."""
        self._validate(request)
        with self._cond:
            if self._closing or self._error is not None:
                raise RuntimeError("engine is closed or failed; create a new Engine")
            rid = self._next_id
            self._next_id += 1
            seed = request.sampling.seed
            if seed is None:
                seed = self._seed_rng.getrandbits(32)
            handle = RequestHandle(rid, self.cancel)
            stop_ids = set(request.sampling.stop_token_ids)
            if not request.sampling.ignore_eos:
                stop_ids |= set(self.config.eos_token_ids)
            detok = Detokenizer(self.tokenizer, request.sampling.stop)
            seq = Sequence(rid, request, handle, seed & 0xFFFFFFFF, frozenset(stop_ids), detok)
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
        d = self.device
        return self._stats.summary(d.busy_s, dict(d.job_s), dict(d.job_n))

    def reset_stats(self) -> None:
        d = self.device
        self._stats = Stats()
        d.busy_s = 0.0
        d.job_s.clear()
        d.job_n.clear()

    def free_pages(self) -> int:
        return self.pool.num_free

    def close(self) -> None:
        """Stop the engine: unfinished requests end CANCELLED, steps in flight are drained."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self.device.close()
        if self._switch_held:  # close() may be called twice
            self._switch_held = False
            switch.release(self.config.switch_interval)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _validate(self, request: Request) -> None:
        cfg = self.config
        n, m = len(request.prompt_ids), request.sampling.max_tokens
        if n == 0:
            raise ValueError("prompt_ids is empty; give at least one token (e.g. the BOS id)")
        if n > cfg.max_step_tokens:
            raise ValueError(f"prompt of {n} tokens exceeds max_step_tokens={cfg.max_step_tokens}; raise it")
        if n + m > cfg.max_model_len:
            raise ValueError(f"prompt {n} + max_tokens {m} exceeds max_model_len={cfg.max_model_len}")
        if pages_needed(n + m - 1, cfg.page_size) > cfg.num_pages:
            raise ValueError(
                f"request needs more KV pages than the pool has ({cfg.num_pages}); lower max_tokens"
            )
        if request.sampling.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need text: create the Engine with a tokenizer, or use stop_token_ids"
            )
        if any(not 0 <= t < self.runner.vocab_size for t in request.prompt_ids):
            raise ValueError(f"prompt_ids must be in [0, {self.runner.vocab_size})")

    # ---- the scheduler thread -----------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._inbox or self._cancels or self._closing or self._busy())
                    closing = self._closing
                if closing:
                    break
                t0 = time.perf_counter()
                self._tick()
                self._stats.active_s += time.perf_counter() - t0
                with self._cond:  # under the lock: a concurrent submit clears the flag after this
                    if not self._busy() and not self._inbox:
                        self._idle.set()
        except BaseException as e:  # a runner or device failure: fail every request, never hang
            self._error = e
        self._shutdown()

    def _busy(self) -> bool:
        return bool(self._inflight) or self.scheduler.has_work()

    def _tick(self) -> None:
        self._take_inbox()
        step = self._launch()
        keep = 1 if step is not None else 0
        texts: list[tuple[Sequence, int]] = []
        while len(self._inflight) > keep:
            self._stream(texts)  # each commit's text is streamed before the next commit
            texts = self._commit_oldest()
        if step is not None:
            if not self.config.pipelined:  # the baseline overlaps nothing: mask after the forward
                self._wait_device()
            self._finalize(step)
        self._stream(texts)  # after finalize: text is not on the path from commit t to sample t+1
        if step is not None and not self.config.pipelined:
            self._stream(self._commit_oldest())

    def _wait_device(self) -> None:
        t0 = time.perf_counter()
        self.device.synchronize()
        self._span("wait", t0)

    def _take_inbox(self) -> None:
        with self._cond:
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for seq in new:
            self._seqs[seq.id] = seq
            self.scheduler.waiting.append(seq)
        for rid in cancels:
            seq = self._seqs.get(rid)
            if seq is not None and not seq.finalized:
                self._finish(seq, FinishReason.CANCELLED)

    def _hook(self, phase: str) -> None:
        if self.config.debug_hook is not None:
            self.config.debug_hook(phase)

    # ---- launch -------------------------------------------------------------------------------
    def _launch(self) -> Step | None:
        t0 = time.perf_counter()
        rows = self.scheduler.schedule()
        if not rows:
            return None
        self._hook("launch")
        slot = self.slots[self._step_no % 2]
        if slot.state is not SlotState.FREE:
            raise AssertionError(f"slot {slot.index} reused before commit read it")
        step = Step(self._step_no, slot, rows)
        self._stage_inputs(step)
        prev = self.slots[(self._step_no - 1) % 2]
        self.device.run("forward", lambda: self._forward(step, prev))
        slot.state, slot.step = SlotState.LAUNCHED, step
        self._inflight.append(step)
        self._step_no += 1
        self._stats.steps += 1
        self._span("launch", t0)
        return step

    def _stage_inputs(self, step: Step) -> None:
        """Write the step's inputs into the slot's host buffers: numpy gathers from the rows' lanes.

        A row's query is its prompt (prefill, output index k = 0) or the token its previous step
        sampled (decode, k > 0), which the forward gathers on the device from `gather_src`.
        """
        rows = step.rows
        ks = [seq.num_scheduled for seq in rows]
        step.lane = np.array([seq.lane for seq in rows], dtype=np.int64)
        for seq in rows:
            seq.num_scheduled += 1
            seq.inflight_refs += 1
        prefill = [row for row, k in enumerate(ks) if k == 0]
        starts = self._stage_positions(step, np.array(ks, dtype=np.int64), prefill)
        self._stage_sources(step, starts, prefill)
        self._stats.prefill_rows += len(prefill)
        self._stats.decode_rows += len(rows) - len(prefill)

    def _stage_positions(self, step: Step, k: np.ndarray, prefill: list[int]) -> np.ndarray:
        """Positions, KV slots, query starts, context lengths, block tables; returns query starts."""
        lanes, lane, ps, hn, n = self.lanes, step.lane, self.config.page_size, step.slot.np, len(step.rows)
        context = lanes.prompt_len[lane] + k  # a prefill's context is its prompt (k = 0)
        if prefill:
            query_len = np.where(k > 0, 1, context)
            starts = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(query_len, out=starts[1:])
            token_row = np.repeat(np.arange(n), query_len)
            positions = np.arange(starts[n]) - starts[token_row] + (context - query_len)[token_row]
            token_lane = lane[token_row]
        else:  # one query token per row
            starts, positions, token_lane = self._arange[: n + 1], context - 1, lane
        t = len(positions)
        pages = lanes.block_table[token_lane, positions // ps]
        hn.positions[:t], hn.slot_mapping[:t] = positions, pages * ps + positions % ps
        hn.query_start[: n + 1], hn.context_lens[:n], hn.counters[:n] = starts, context, k
        # Pages that hold this step's context, not every page reserved at admission: attention
        # gathers (and traced decode pads) the table's width, so reserved-but-empty pages cost.
        width = pages_needed(int(context.max()), ps)
        hn.block_tables[:n, :width] = lanes.block_table[lane, :width]
        step.num_tokens, step.table_width = t, width
        step.max_query_len = int(query_len.max()) if prefill else 1
        step.max_context_len = int(context.max())
        return starts

    def _stage_sources(self, step: Step, starts: np.ndarray, prefill: list[int]) -> None:
        """Where input ids come from: decode rows' previous samples (gathered on the device), prompts."""
        lanes, lane, hn, rows, n = self.lanes, step.lane, step.slot.np, step.rows, len(step.rows)
        decode_rows = np.setdiff1d(self._arange[:n], prefill) if prefill else self._arange[:n]
        decode_lanes = lane[decode_rows]
        if not (lanes.last_step[decode_lanes] == step.number - 1).all():
            raise AssertionError("a running sequence skipped a step")
        d = len(decode_rows)
        hn.gather_dst[:d], hn.gather_src[:d] = starts[decode_rows], lanes.last_row[decode_lanes]
        lanes.last_step[lane], lanes.last_row[lane] = step.number, self._arange[:n]
        extras: list[Any] = []
        for row in prefill:  # their prompt tokens go up as they are
            request = rows[row].request
            hn.input_ids[starts[row] : starts[row + 1]] = request.prompt_ids
            if request.extras is not None:
                extras = extras or [None] * n
                extras[row] = request.extras
        step.num_decode, step.extras = d, extras

    @torch.inference_mode()
    def _forward(self, step: Step, prev: DecodeSlot) -> None:
        """Device work: upload inputs, gather decode ids from the previous step's samples, run the model."""
        slot, n, t, d, width = step.slot, len(step.rows), step.num_tokens, step.num_decode, step.table_width
        slot.upload(
            (
                "input_ids",
                "positions",
                "slot_mapping",
                "query_start",
                "context_lens",
                "block_tables",
                "gather_dst",
                "gather_src",
            ),
            (t, t, t, n + 1, n, n, d, d),
        )
        dev = slot.dev
        if d:
            dev.input_ids.index_copy_(0, dev.gather_dst[:d], prev.sampled.index_select(0, dev.gather_src[:d]))
        batch = ForwardBatch(
            input_ids=dev.input_ids[:t],
            positions=dev.positions[:t],
            query_start=dev.query_start[: n + 1],
            context_lens=dev.context_lens[:n],
            block_tables=dev.block_tables[:n, :width],
            slot_mapping=dev.slot_mapping[:t],
            max_query_len=step.max_query_len,
            max_context_len=step.max_context_len,
            extras=step.extras,
        )
        slot.logits = self.runner.forward(batch)

    # ---- finalize -----------------------------------------------------------------------------
    def _finalize(self, step: Step) -> None:
        """Masks from the current matchers, then queue the sampler and the copy of its ids to the host."""
        t0 = time.perf_counter()
        self._hook("finalize")
        slot, h, n = step.slot, step.slot.host, len(step.rows)
        constrained = [
            (row, seq.matcher)
            for row, seq in enumerate(step.rows)
            if seq.matcher is not None and not seq.finalized
        ]
        c = len(constrained)
        hn = slot.np
        if c:
            hn.bitmask[:c] = 0
            self.config.fill_masks([m for _, m in constrained], h.bitmask[:c])
            hn.mask_rows[:c] = [row for row, _ in constrained]
        lane = step.lane  # sampling parameters were written into the lanes at admission
        hn.temperature[:n], hn.top_p[:n] = self.lanes.temperature[lane], self.lanes.top_p[lane]
        hn.top_k[:n], hn.seeds[:n] = self.lanes.top_k[lane], self.lanes.seed[lane]
        random_rows = np.flatnonzero(hn.temperature[:n] > 0)
        r = len(random_rows)
        hn.random_rows[:r] = random_rows
        filter_rows = bool(((hn.top_k[random_rows] > 0) | (hn.top_p[random_rows] < 1)).any())
        self.device.run("sample", lambda: self._sample(slot, n, r, c, filter_rows))
        debug = self.config.debug and self.device.device.type == "cpu"
        slot.event = self.device.copy_to_host("copy", lambda: self._copy(slot, n, debug))
        slot.state = SlotState.FINALIZED
        self._span("finalize", t0)

    @torch.inference_mode()  # runners return inference tensors; the sampler masks them in place
    def _sample(self, slot: DecodeSlot, n: int, r: int, c: int, filter_rows: bool) -> None:
        slot.upload(
            ("temperature", "top_p", "top_k", "seeds", "counters", "random_rows", "mask_rows", "bitmask"),
            (n, n, n, n, n, r, c, c),
        )
        dev = slot.dev
        batch = SamplingBatch(
            temperature=dev.temperature[:n],
            top_p=dev.top_p[:n],
            top_k=dev.top_k[:n],
            seeds=dev.seeds[:n],
            counters=dev.counters[:n],
            random_rows=dev.random_rows[:r] if r else None,
            filter_rows=filter_rows,
            bitmask=dev.bitmask[:c] if c else None,
            mask_rows=dev.mask_rows[:c] if c else None,
        )
        sample(slot.logits, batch, slot.sampled)
        slot.logits = None

    @staticmethod
    def _copy(slot: DecodeSlot, n: int, debug: bool) -> None:
        if debug:
            slot.check_poisoned(n)
        slot.sampled_host[:n].copy_(slot.sampled[:n], non_blocking=True)

    # ---- commit -------------------------------------------------------------------------------
    def _commit_oldest(self) -> list[tuple[Sequence, int]]:
        """Commit the oldest step's tokens; returns the (sequence, token) pairs still to detokenize."""
        step = self._inflight[0]  # stays in flight until read, so a device failure can still drain it
        slot = step.slot
        t0 = time.perf_counter()
        self.device.wait(slot.event)
        self._inflight.popleft()
        t1 = time.perf_counter()
        self._stats.phase_s["wait"] += t1 - t0
        self.trace.span("wait", "scheduler", t0, t1)
        self._hook("commit")
        ids = slot.read_sampled(len(step.rows), self.config.debug)
        slot.state, slot.step, slot.event = SlotState.FREE, None, None
        texts = []
        for seq, token in zip(step.rows, ids, strict=True):
            seq.inflight_refs -= 1
            if not seq.finalized:
                if self._append(seq, token):
                    texts.append((seq, token))
            elif seq.inflight_refs == 0:  # a zombie's last step: its token is dropped
                self.scheduler.release(seq)
        self._span("commit", t1)
        return texts

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append a token and finish the sequence if a stop needs no text; True: its text is due."""
        seq.num_committed += 1
        self._stats.tokens += 1
        matcher = seq.matcher
        if matcher is not None:
            try:
                matcher.commit(token)
            except Exception as e:  # the request fails, the engine carries on
                self._finish(seq, FinishReason.ERROR, f"matcher refused token {token}: {e}")
                return False
        if token in seq.stop_ids:
            self._finish(seq, FinishReason.STOP)
            return False
        seq.token_ids.append(token)
        terminated = matcher is not None and matcher.is_terminated()
        if terminated or seq.num_committed >= seq.max_tokens:
            seq.detok.add(token)  # its final text; a stop string in it makes the reason STOP
            stop = terminated or seq.detok.stopped
            self._finish(seq, FinishReason.STOP if stop else FinishReason.LENGTH)
            return False
        return True

    def _stream(self, texts: list[tuple[Sequence, int]]) -> None:
        """Detokenize committed tokens, end sequences on stop strings, push text deltas."""
        if not texts:
            return
        t0 = time.perf_counter()
        for seq, token in texts:
            detok = seq.detok
            detok.add(token)
            if detok.stopped:
                self._finish(seq, FinishReason.STOP)
            elif delta := detok.release(final=False):
                seq.handle._push(delta)
        self._span("text", t0)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        seq.finalized = True
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seq.detok.flush()
        if delta := seq.detok.release(final=True):
            seq.handle._push(delta)
        del self._seqs[seq.id]
        output = RequestOutput(list(seq.token_ids), seq.detok.text, reason, seq.prompt_len, error)
        if seq.inflight_refs == 0:
            self.scheduler.release(seq)
        seq.handle._finish(output)

    # ---- shutdown -----------------------------------------------------------------------------
    def _shutdown(self) -> None:
        """Cancel what is left and drain the steps in flight, so every page and slot comes back."""
        self._take_inbox()
        for seq in list(self._seqs.values()):
            self._finish(
                seq,
                FinishReason.CANCELLED if self._error is None else FinishReason.ERROR,
                repr(self._error) if self._error else None,
            )
        with contextlib.suppress(Exception):  # a failed device has nothing more to deliver
            self.device.synchronize()
        while self._inflight:  # every sequence is finalized now: each step is zombies only
            step = self._inflight.popleft()
            for seq in step.rows:
                seq.inflight_refs -= 1
                if seq.inflight_refs == 0:
                    self.scheduler.release(seq)
            step.slot.sampled_host.fill_(POISON)
            step.slot.state, step.slot.step, step.slot.event = SlotState.FREE, None, None
        self._idle.set()

    def _span(self, name: str, t0: float) -> None:
        t1 = time.perf_counter()
        self._stats.phase_s[name] += t1 - t0
        self.trace.span(name, "scheduler", t0, t1)
