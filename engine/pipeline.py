"""The two-slot pipeline as a steppable state machine: one `tick()` is launch, commit, finalize, text.

PROBLEM
    The accelerator must never wait for Python bookkeeping (appending tokens, advancing grammar
    matchers, detokenizing, stop checks), and constrained decoding must run ahead like
    unconstrained decoding does. The machinery must also be testable one step at a time, without
    threads or timing.
SOLUTION
    `tick()` (docs/architecture.md, "The engine"):
      1. launch step t+1 into the free DecodeSlot; its decode rows' input ids are gathered on the
         device from where step t's sampler wrote them;
      2. commit step t: wait for its host copy, read it, free its slot, append tokens, advance
         matchers, detect the stops that need no text (EOS and stop ids, grammar end, max_tokens);
      3. finalize step t+1: fill the masks from the just-advanced matchers, queue the sampler and
         the host copy;
      4. text of step t: detokenize, find stop strings, stream deltas.
    The device runs forward t+1 while the host commits t. Sample t+1 waits for commit t and
    finalize t+1, so those two must fit inside forward t+1; launch and text need only fit in the
    whole step, which is why text comes last. Blocking mode (`pipelined=False`) is the same tick
    in which a launch returns only once its forward has run, and the step is committed right after
    finalize: nothing overlaps, the baseline of comparisons. A sequence that finishes at commit t
    may ride in step t+1 as a zombie: its token there is dropped, its pages wait for inflight_refs 0.
    DECODE BURSTS (bursts.py): a step whose rows need nothing from the host between two tokens (no
    grammar, logprobs, drafts or forced run) and that no waiting request would join runs up to
    `decode_burst` decode sub-steps in one device job, committed like accepted drafts.
    The pipeline owns no thread: `Engine` calls `tick()` from its scheduler thread, and tests call
    it directly over a device that runs queued jobs only when waited on (foveal.testing).
    What it calls on its device (`device.Device`) is checked when it is built, and so is what it
    may call on its runner beyond `ModelRunner` (`regions.RegionHeads`); what it may call on a
    matcher beyond `Matcher` was resolved at submit (sequence.Sequence). A step uses those
    resolved flags and bound methods: it never probes a matcher or runner for a capability.
MASKS
    Finalize fills the masks of the step's live constrained rows in one `FillMasks` call; rows
    whose matcher fills its own mask (`matcher.OwnMask`) come after the others in the step's mask
    buffers and are filled by their own `fill_mask`, so the batched call only ever sees matchers
    it understands.
JUMP-FORWARD (docs/architecture.md, "The engine")
    Where the grammar forces the next tokens F = f0..f(k-1) (JSON keys and punctuation, say),
    decoding them one step each wastes k - 1 forwards. Finalize t+1 asks each live constrained
    row's matcher that offers it (`matcher.ForcedTokens`), now exactly in the state step t+1's
    logits continue, for F (`forced_tokens`).
    If k >= 2 and f0 is in the row's filled mask, the mask is narrowed to f0 alone (so the sample
    of t+1 *is* f0, whatever the temperature: llguidance's canonical tokenization of the forced
    text), F is pinned on the step (`Step.pinned`) and on the sequence (`Sequence.jump`). The next
    launch, t+2, carries that row with the query F (all k tokens from the host: f0 is known, no
    device gather), writing their K/V in one forward; its logits are those after f(k-1) and its
    output index moves k on. Commit t+1 appends the sampled f0 and then f1..f(k-1), so the
    matcher is in the right state for finalize t+2. In pipelined mode launch t+2 precedes
    commit t+1; in blocking mode it follows it; both read their own copy of F, so the two modes
    take the same decisions at the same steps (invariant 1).
    Slots and zombies are untouched by this: a jump row is one row of one step like any other. It
    holds its DecodeSlot rows as a decode row does, its forced tokens were pinned before the
    launch, never read back from a slot. If the sequence ends at commit t+1 (cancel, error, the
    grammar completing inside F), the t+2 row is a zombie: its tokens are dropped and its pages
    wait for inflight_refs 0. k is capped so that the sampled token after F stays below
    max_tokens and the next step's running rows fit max_step_tokens.
FINAL RUNS
    A JSON answer ends in forced text (`"]}`, say): the grammar completes inside F. Carrying F in
    the launch after the pin would compute K/V and logits nobody reads, a whole zombie row; when
    32 answers of one shape end together, a whole step of them. So finalize also asks the matcher
    (`ends_after(F)`) whether committing F completes the output; if so, F (any k >= 1)
    is pinned on the step alone, the sequence is marked `final_run` and `schedule()` gives it no
    further launch: commit t+1 appends the sampled f0 and f1..f(k-1), and the grammar's end
    finishes it there. A final run is capped only by max_tokens (F's last token stays below it).
    Should the commit not finish it (a matcher whose `ends_after` was wrong), it ends with ERROR
    rather than wait for a launch that never comes.
SPECULATIVE DECODING (`speculative="ngram"`; drafts.py)
    At a few rows a step the forward reads the weights once however many query tokens it carries,
    so a row may carry k guessed tokens D = d1..dk after its input (a *verify row*, step.py) and
    get the logits after each of its k + 1 query tokens: its positions are launched as k + 1 rows
    of one token each over its pages, which a runner declares it can run (runner.SharedPages;
    speculation is refused without it), so a verify step is a decode launch (traced graphs on CPU).
    Drafts: prompt lookup over the committed context (prompt + output, drafts.py), only in steps
    of fewer than `drafts.MAX_LAUNCH_ROWS` rows, for rows whose matcher can roll back (or that
    have none) and has no region steps, never for prefill chunks or a jump row of k >= 2 (a forced
    run is its own multi-token query). k is capped so that the last position samples below
    max_tokens (its K/V position is then among the pages reserved at admission), and so that the
    step stays within max_batch (and `drafts.MAX_LAUNCH_ROWS`) logit rows and max_step_tokens.
    Launch t+1 plans them. In pipelined mode a decode row's step-t sample is still in flight: the
    lookup's first token g is a guess of it, the row's input is gathered on the device as usual
    (the real sample), and D is what the lookup continues after g. Before launch the matcher (after
    commit t-1) is probed with g, D: committed one by one and rolled back; D is cut at the first
    token it refuses, so a draft the grammar forbids is never launched.
    Finalize t+1 fills position 0's mask as for any row; position i's mask is the matcher's (after
    commit t) advanced tentatively through d1..di, then rolled back. If a draft is refused there
    (the sample differed from g), that position and the later ones allow every token: the sample
    before them is masked against the refused draft, so none of them can be accepted. Every
    position is sampled with its own output index as counter (n .. n + k).
    Commit t+1 accepts the samples s0.. while s(i) = d(i+1), then the first that differs (or the
    last): a + 1 tokens for a accepted drafts. With counter-based Gumbel noise (sampler.py) the
    sample at a position is a function of its context and its output index alone, so a position
    whose context equals decoding's (every draft before it accepted) samples what decoding would:
    greedy and seeded outputs are token-identical to decoding without drafts, in both modes, and
    for any distribution this is the rejection sampling of a one-hot proposal (accept d with
    probability p(d); otherwise a sample of p without d). That holds token for token only if each
    position also gets the same mask and the same arithmetic as in decoding (JUMPS, NUMERICS).
    Accepted tokens are appended and their text done one by one (a stop inside the run ends the
    output where decoding would have).
    The launch after a verify step (t+2) cannot know how many drafts commit t+1 accepts: the row
    sits t+2 out (`Sequence.verifying`; its num_scheduled counts every draft until the commit sets
    it to what was committed). Commit t+1 leaves its last token, not yet in the KV, as a one-token
    jump: launch t+3 carries it from the host, with drafts of its own if the lookup finds some
    (its context is then complete: no guess). Blocking mode commits t+1 before launch t+2, so the
    row never sits out there; the two modes may draft differently, but tokens are identical.
    Rejected drafts' K/V lies past the row's context in its own reserved pages, never in a
    registered prefix page, and is overwritten before any query attends to it: no page is taken
    or freed per draft. A row whose verify step is in flight when it finishes is a zombie as any.
JUMPS (speculative decoding and jump-forward)
    Where the grammar forces a run F, decoding narrows that position's mask to f0 (llguidance's
    canonical tokens of the forced text; the full mask may allow another spelling) and carries F
    as one query. A verify row's logit row sampling there would pick freely among the spellings,
    and compute F's positions as decode rows instead of one query. So no logit row of a verify
    row samples where the grammar forces a run (`_would_jump`: two forced tokens or more, or any
    that end the output; a superset of where `_pin_forced` pins): the probe at launch cuts the
    drafts before such a state, and finalize, which sees the matcher after the real sample (the
    guess the drafts followed may have been wrong), cuts the accepted drafts there too; where the
    row's first logit row is such a state, `_pin_forced` pins it as any row, and its drafts are
    void (the commit takes its first sample as a pinned row's, then F as decoding would).
NUMERICS
    A position's logits must not depend on whether it was guessed. A verify launch (up to
    `drafts.MAX_LAUNCH_ROWS` rows, one token each) differs from a decode launch in its rows, and
    rows are read in whole pages of the launch's longest context. Runner kernels whose rounding
    depends on the row count would change the logits (the engine's quantized linears do not below
    their few-row threshold: quant.py); CPU attention rounds with the keys it pads a row to, so
    a row's drafts stay in the KV page of its first position (a guessed position then sees the
    keys its decode launch would have). Calls batched with others are padded to their neighbours'
    longest context, drafts or not; a verify row sitting a launch out changes its neighbours'
    padding, so there the identity holds only as far as the kernels are exact.
INVARIANTS (tests/engine/test_pipeline_steps.py steps ticks one by one and checks each)
    1. Greedy or seeded outputs are token-identical in pipelined and blocking mode.
    2. Nothing is emitted after a stop; a zombie's token is dropped.
    3. Step t+1's mask comes from the matcher after committing t.
    4. Every page and slot is freed exactly once, after inflight_refs is 0; at idle the pools are full.
    5. A slot's host buffers are never overwritten before commit has read them: a launch takes a
       slot only once commit has read it (FREE), and steps commit oldest first.
    6. After a tick at most one step is in flight (pipelined) or none (blocking).
    7. A sequence is never launched for an output index >= its max_tokens.
    8. Jump-forward: a pinned row samples exactly f0; the launch after it carries F and nothing
       else for that row (a final run's row: nothing at all); outputs are valid under the grammar
       and equal in both modes.
    9. Speculative decoding (tests/engine/test_speculative.py): outputs equal decoding without
       drafts token for token (greedy and seeded, both modes); no launched draft is refused by the
       grammar at launch; no logit row samples at or past max_tokens and a step has at most
       max_batch of them; a verify row is not launched again before its commit.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, cast

import numpy as np

from . import bursts, device_jobs, drafts, regions
from .device import Device
from .device_jobs import SampleShape
from .drafts import Drafter, DraftStats
from .kv_cache import PagePool, pages_needed
from .lanes import Lanes
from .matcher import FillMasks, bitmask_words, conforms, require
from .request import FinishReason, TokenLogprob
from .runner import Continues, ModelRunner, OwnsKV, own_threads, owns_kv, shares_pages, sliding_window
from .scheduler import Scheduler
from .sequence import Sequence
from .sequences import Sequences
from .sliding import SlidingPages
from .slot import POISON, DecodeSlot, SlotState
from .stats import Stats
from .step import Step, stage, stage_sampling
from .trace import Trace

if TYPE_CHECKING:
    import torch

Committed = list[tuple[Sequence, int]]  # (sequence, token) pairs whose text is still due
MAX_JUMP = 64  # forced tokens one jump carries at most (a longer forced run takes several)
# query positions a decode launch gives one row at most: a jump, or a verify step's input and drafts (sliding.py)
DECODE_SPAN = max(MAX_JUMP, drafts.MAX_DRAFT + 1)


class Pipeline:
    def __init__(
        self,
        runner: ModelRunner,
        device: Device,
        *,
        pipelined: bool,
        max_batch: int,
        max_step_tokens: int,
        page_size: int,
        num_pages: int,
        max_model_len: int,
        fill_masks: FillMasks,
        jump_forward: bool = False,
        speculative: str | None = None,
        decode_burst: int = 1,
        prefill_chunk: int | None = None,
        sliding_pages: int | None = None,
        debug: bool = False,
        debug_hook: Callable[[str], None] | None = None,
        trace: Trace | None = None,
    ) -> None:
        require(device, Device, "device", "foveal.engine.device.Device")
        self.speculative = check_speculative(speculative, runner, conforms(runner, regions.RegionHeads))
        self.runner = runner
        self.device = device
        self.pipelined = pipelined
        self.page_size = page_size
        self.fill_masks = fill_masks
        self.jump_forward = jump_forward
        self.debug = debug
        self.debug_hook = debug_hook
        self.trace = trace or Trace(False)
        self.stats = Stats()
        self.draft_stats = DraftStats()
        self.max_batch = max_batch
        self.pool = PagePool(num_pages, page_size)
        max_pages = pages_needed(max_model_len, page_size)
        window = sliding_window(runner) if sliding_pages is not None else None
        self.lanes = Lanes(2 * max_batch, max_pages, sliding=window is not None)
        # the sliding-window layers' own pool (sliding.py), for a runner that has such layers
        self.sliding = None
        if window is not None:
            chunk = prefill_chunk or max_step_tokens
            assert sliding_pages is not None and self.lanes.sliding_table is not None  # with the window
            self.sliding = SlidingPages(sliding_pages, page_size, window, chunk, DECODE_SPAN, self.lanes.sliding_table)
        self.scheduler = Scheduler(self.pool, self.lanes, max_batch, max_step_tokens, prefill_chunk, self.sliding)
        self.sequences = Sequences(self.scheduler, self.stats)
        self.slots = [
            DecodeSlot(i, device, max_batch, max_step_tokens, max_pages, bitmask_words(runner.vocab_size))
            for i in range(2)
        ]
        self.inflight: deque[Step] = deque()
        self.step_number = 0
        self._row_numbers = np.arange(max_batch + 1)
        # some steps may sample region values (regions.py): the runner's heads, or None
        self.heads: regions.RegionHeads | None = runner if conforms(runner, regions.RegionHeads) else None
        self.region_logprobs = self.heads is not None and conforms(runner, regions.RegionLogprobs)
        # decode bursts (bursts.py): sub-steps a step of rows that need no host work between tokens
        # may run; never with region heads (a row's next step kind is the host's), sliding windows,
        # or drafts (a lookup would have to guess a whole burst in flight before drafting past it)
        if isinstance(decode_burst, bool) or not isinstance(decode_burst, int) or decode_burst < 1:
            raise ValueError(f"decode_burst must be an int >= 1 (1: no bursts), got {decode_burst!r}")
        plain = self.heads is None and self.sliding is None and not self.speculative
        self.decode_burst = decode_burst if plain else 1
        # a burst's sub-steps after its first, without a ForwardBatch (runner.Continues: a host runner's)
        host = runner.device.type == "cpu"
        self.continues: Continues | None = runner if host and conforms(runner, Continues) else None
        self.owns_kv = owns_kv(runner)
        self.own_threads = own_threads(runner)  # ggml's pool: torch's thread count is not its (runner.OwnThreads)
        if self.owns_kv:  # its K/V is its own: a sequence per lane (runner.OwnsKV)
            cast(OwnsKV, runner).allocate_streams(
                num_pages, page_size, self.lanes.count, max_model_len, max_step_tokens
            )
        elif self.sliding is not None:
            # a SlidingWindow runner's allocate_kv takes sliding_pages (runner.SlidingWindow)
            runner.allocate_kv(num_pages, page_size, sliding_pages=sliding_pages)  # type: ignore[call-arg]
        else:
            runner.allocate_kv(num_pages, page_size)

    def has_work(self) -> bool:
        return bool(self.inflight) or self.scheduler.has_work()

    def tick(self) -> None:
        """One step of the pipeline (see the module docstring)."""
        step = self.launch()  # 1. forward t+1
        committed = self.commit_previous(step)  # 2. commit t
        if step is not None:
            self.finalize(step)  # 3. masks from the matchers after commit t; sample t+1
            if not self.pipelined:
                committed += self.commit_oldest()  # blocking mode: commit right after finalize
        self.text(committed)  # 4. text of the committed tokens

    # ---- 1. launch ----------------------------------------------------------------------------
    def launch(self) -> Step | None:
        started = time.perf_counter()
        rows = self.scheduler.schedule()
        if not rows:
            return None
        self._hook("launch")
        slot = self.slots[self.step_number % 2]
        if slot.state is not SlotState.FREE:
            raise AssertionError(f"slot {slot.index} reused before commit read it")
        step = Step(self.step_number, slot, rows)
        if self.speculative:
            self._plan_drafts(step)
        burst = self._burst_length(step)
        if burst:
            bursts.stage(step, self.lanes, self.page_size, burst)
            prefill_rows = []
        else:
            prefill_rows = stage(step, self.lanes, self.page_size, self._row_numbers, self.sliding)
        assert step.extra is not None  # by stage()
        for row, (seq, extra) in enumerate(zip(rows, step.extra.tolist(), strict=True)):
            # a partial chunk samples nothing; a verify row counts every draft until its commit says
            seq.num_scheduled += 0 if row in step.partial else 1 + extra
            seq.inflight_refs += 1
        for row in step.drafts:
            rows[row].verifying = True
        previous_slot = self.slots[(self.step_number - 1) % 2]
        runner, heads, device, continues = self.runner, self.heads, self.device, self.continues
        # the count is picked where the forward runs, as it starts: the device times it (device.py);
        # a runner on a thread pool of its own (runner.OwnThreads) leaves torch's count alone
        threads_for = device.threads_for if self.own_threads is None else lambda tokens, forwards=1: None
        if burst:  # k forwards of one token a row: threads as for one of them, timed apart from them
            self.device.run(
                "burst",
                lambda: bursts.forward(runner, step, previous_slot, threads_for(step.num_rows, burst), continues),
            )
        else:
            self.device.run(
                "forward",
                lambda: device_jobs.forward(runner, step, previous_slot, threads_for(step.num_tokens), heads),
            )
        slot.state, slot.step = SlotState.LAUNCHED, step
        self.inflight.append(step)
        self.step_number += 1
        self.stats.count_step(len(prefill_rows), len(rows) - len(prefill_rows))
        self.stats.burst_steps += burst > 0
        for row in prefill_rows:
            if row not in step.partial:  # once per prompt, at its last chunk
                self.stats.count_prompt(rows[row].prompt_len, rows[row].num_cached)
        self._span("launch", started)
        if not self.pipelined:  # the baseline overlaps nothing: the forward ends before the masks
            self._wait_device()
        return step

    def _burst_length(self, step: Step) -> int:
        """The sub-steps of a decode burst (bursts.py) this step runs; 0 when it is no burst: bursts
        are off, a request waits (it is admitted at the next launch), a row drafts or needs the host
        between its tokens."""
        if self.decode_burst < 2 or step.drafts or self.scheduler.waiting:
            return 0
        if not all(bursts.burstable(seq) for seq in step.rows):
            return 0
        return bursts.length(step.rows, self.decode_burst, self.max_batch, self.scheduler.max_step_tokens)

    def _plan_drafts(self, step: Step) -> None:
        """Speculative decoding (module docstring): give the step's decode rows and one-token jump
        rows the drafts of their prompt lookup, cut where the grammar refuses one, within the step's
        room for logit rows and query tokens."""
        rows = step.rows
        room = min(self.max_batch, drafts.MAX_LAUNCH_ROWS) - len(rows)  # logit rows beyond one a row
        if room < 1:  # a step of many rows: nothing to look at (as cheap as decoding without drafts)
            return
        decoding = [row for row, seq in enumerate(rows) if seq.num_scheduled > 0 and seq.num_prefilled == seq.prompt_len]
        if not decoding:
            return
        tokens = self.scheduler.max_step_tokens - sum(
            seq.chunk if seq.num_scheduled == 0 else len(seq.jump or (0,)) for seq in rows
        )
        stats = self.draft_stats
        for row in decoding:
            seq = rows[row]
            if not seq.can_draft or (seq.jump is not None and len(seq.jump) > 1):
                continue  # a forced run is its own multi-token query: no drafts after it
            # the drafts' last sample must stay below max_tokens (its K/V position is then reserved);
            # and their positions stay in the page of the row's first one: attention's rounding
            # depends on the keys it pads a launch's rows to (whole pages of its longest context),
            # so a guessed position must see the keys its decode would (NUMERICS)
            page_room = -(seq.prompt_len + seq.num_scheduled) % self.page_size
            cap = min(drafts.MAX_DRAFT, seq.max_tokens - 1 - seq.num_scheduled, room, tokens, page_room)
            if cap < 1:
                stats.capped += 1
                continue
            # Pipelined, a decode row's previous sample is still in flight: the lookup's first token
            # is its guess, and only what follows it is drafted (the gathered input is the real sample).
            guessed = seq.num_scheduled - seq.num_committed
            if seq.drafter is None:
                seq.drafter = Drafter(seq.request.prompt_ids)
            backing_off = seq.drafter.skip > 0
            proposal = seq.drafter.propose(seq.token_ids, cap + guessed)
            if backing_off:
                stats.backed_off += 1
                continue
            stats.lookups += 1
            if len(proposal) <= guessed:  # nothing past the guess of the sample in flight
                stats.no_match += 1
                continue
            stats.proposed += len(proposal) - guessed
            if seq.matcher is not None:
                # no logit row where the grammar forces a run: decoding would jump over it (JUMPS)
                stop = partial(_would_jump, seq) if self.jump_forward and seq.forced_tokens is not None else None
                assert seq.rollback is not None  # can_draft: its matcher rolls back
                kept = max(drafts.probe(seq.matcher.commit, seq.rollback, proposal, stop, guessed), guessed)
                stats.cut += len(proposal) - kept
                proposal = proposal[:kept]
            if len(proposal) > guessed:
                step.drafts[row] = proposal[guessed:]
                room -= len(proposal) - guessed
                tokens -= len(proposal) - guessed
                stats.verify_rows += 1
                stats.drafted += len(proposal) - guessed

    # ---- 2. commit ----------------------------------------------------------------------------
    def commit_previous(self, launched: Step | None) -> Committed:
        """Commit the step before `launched` (every step in flight when nothing was launched)."""
        older = len(self.inflight) - (launched is not None)
        if older > 1:
            raise AssertionError(f"{older} steps in flight before the launched one; the pipeline is 2 deep")
        return self.commit_oldest() if older else []

    def commit_oldest(self) -> Committed:
        """Commit the oldest step's tokens; returns the (sequence, token) pairs whose text is due."""
        step = self.inflight[0]  # stays in flight until read, so a device failure can still drain it
        slot = step.slot
        waited = time.perf_counter()
        self.device.wait(slot.event)
        self.inflight.popleft()
        started = time.perf_counter()
        self.stats.phase_s["wait"] += started - waited
        self.trace.span("wait", "scheduler", waited, started)
        self._hook("commit")
        samples = slot.read_sampled(step.num_logits, self.debug)
        logprobs = self._read_logprobs(step, samples)
        slot.state, slot.step, slot.event = SlotState.FREE, None, None
        committed = []
        assert step.logit_start is not None  # by stage()
        starts: list[int] | None = step.logit_start.tolist() if step.drafts or step.burst else None
        for row, seq in enumerate(step.rows):
            seq.inflight_refs -= 1
            last = starts[row + 1] - 1 if starts is not None else row  # the row's last logit row
            token = samples[last]
            if row in step.partial and not seq.finalized:  # a prompt chunk that is not its last: no token
                continue
            if not seq.finalized and step.burst:  # a burst row: its k samples, one by one (bursts.py)
                assert starts is not None  # a burst step
                self._append_run(seq, samples[starts[row] : last + 1])
            elif not seq.finalized and row in step.drafts and row not in step.pinned:
                assert starts is not None  # a step with drafts
                first = starts[row]
                self._commit_verified(seq, step.drafts[row], samples[first : last + 1], logprobs, first)
            elif not seq.finalized:
                if row in step.drafts:  # a verify row finalize pinned (_pin_forced): its drafts are void
                    assert starts is not None  # a step with drafts
                    last = starts[row]
                    token = samples[last]
                    seq.verifying = False
                    seq.num_scheduled -= starts[row + 1] - 1 - last  # it counted every draft at launch
                if seq.num_committed == 0 and seq.prefix_chain:  # its prompt's K/V is written now
                    self.scheduler.register_prefix(seq)
                forced = step.pinned.get(row)
                if forced is not None and token != forced[0]:
                    self.sequences.finish(
                        seq, FinishReason.ERROR, f"jump-forward: sampled {token} where the mask allowed only {forced[0]}"
                    )
                    continue
                logprob = logprobs[last] if logprobs is not None else None
                if forced is not None:
                    self._append_forced(seq, forced, logprob)
                    if seq.final_run and not seq.finalized:  # never left running with no launch to come
                        self.sequences.finish(
                            seq, FinishReason.ERROR, "jump-forward: a forced run said to complete the output did not"
                        )
                elif self.sequences.append(seq, token, logprob):
                    committed.append((seq, token))
            elif seq.inflight_refs == 0:  # a zombie's last step: its token is dropped
                self.scheduler.release(seq)
        self._span("commit", started)
        return committed

    def _commit_verified(
        self, seq: Sequence, guesses: list[int], samples: list[int], logprobs: list | None, first: int
    ) -> None:
        """A verify row's commit: the samples while they equal the drafts, then the first that does not.

        Their text is done token by token, as a forced run's is (`_append_forced`): a stop inside
        the accepted run must end the output exactly where decoding without drafts would have.
        The next launch carries the last of them from the host (a one-token jump).
        """
        accepted = 0
        while accepted < len(guesses) and samples[accepted] == guesses[accepted]:
            accepted += 1
        seq.verifying = False
        if guesses:  # none left: finalize cut them all (JUMPS), which is no verdict on the lookup
            assert seq.drafter is not None  # it drafted them
            seq.drafter.verdict(accepted)
            self.draft_stats.rejected += not accepted
        self.draft_stats.accepted += accepted
        self._append_run(seq, samples[: accepted + 1], logprobs[first:] if logprobs is not None else None)
        if seq.finalized:
            return
        seq.num_scheduled = seq.num_committed  # it counted every draft at launch
        seq.jump = [samples[accepted]]

    def _append_run(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> None:
        """Commit several sampled tokens of one row (accepted drafts, a burst), their text token by
        token: a stop inside the run ends the output where decoding one token a step would have."""
        for index, token in enumerate(tokens):
            logprob = logprobs[index] if logprobs is not None else None
            if self.sequences.append(seq, token, logprob):
                self.sequences.stream([(seq, token)])
            if seq.finalized:
                return

    def _read_logprobs(self, step: Step, tokens: list[int]) -> list[TokenLogprob | None] | None:
        """Per logit row, the sampled token's TokenLogprob when its sequence asked for logprobs."""
        if step.top_logprobs < 0:
            return None
        chosen, top_ids, top_values = step.slot.read_logprobs(step.num_logits, step.top_logprobs)
        kinds = step.slot.np.kinds if self.heads is not None else None
        assert step.row_of_logit is not None  # by stage()
        out: list[TokenLogprob | None] = []
        for row, row_of in enumerate(step.row_of_logit.tolist()):  # rows: logit rows
            seq = step.rows[row_of]
            k = seq.logprobs_k
            if k < 0:
                out.append(None)
            elif kinds is not None and kinds[row] != 0 and not self.region_logprobs:  # no distribution recorded
                out.append(TokenLogprob(tokens[row], math.nan))
            else:
                top = tuple((i, v) for i, v in zip(top_ids[row][:k], top_values[row][:k], strict=True) if v > -math.inf)
                out.append(TokenLogprob(tokens[row], chosen[row], top))
        return out

    def _append_forced(self, seq: Sequence, forced: list[int], logprob: TokenLogprob | None = None) -> None:
        """Commit the sampled f0, then f1..f(k-1) (their K/V is the next launch's work).

        Their text is done here, token by token, not in the text phase: a later token of the run
        can end the sequence (the grammar completes), and its final text must hold the earlier ones.
        f0's logprob is the sampler's (its mask allowed f0 alone: 0.0); f1.. were never sampled.
        """
        for index, token in enumerate(forced):
            if seq.finalized:
                break
            self.stats.forced_tokens += index > 0
            if self.sequences.append(seq, token, logprob if index == 0 else None):
                self.sequences.stream([(seq, token)])

    # ---- 3. finalize --------------------------------------------------------------------------
    def finalize(self, step: Step) -> None:
        """Masks from the current matchers, then queue the sampler and the copy of its ids to the host."""
        started = time.perf_counter()
        self._hook("finalize")
        slot, num_rows = step.slot, step.num_logits  # rows here: logit rows
        # a burst's forward job sampled every sub-step (bursts.py): only the copy is left
        top = self._queue_sample(step) if step.burst is None else -1
        debug = self.debug and self.device.device.type == "cpu"
        slot.event = self.device.copy_to_host(
            "copy", lambda: device_jobs.copy_to_host(slot, num_rows, debug, top)
        )
        slot.state = SlotState.FINALIZED
        self._span("finalize", started)

    def _queue_sample(self, step: Step) -> int:
        """Fill the masks, pin forced runs, stage the sampling parameters and queue the sampler;
        returns the alternatives the step records per row (-1: no logprobs)."""
        slot, host, num_rows = step.slot, step.slot.np, step.num_logits
        num_first, num_masked = self._fill_masks(step)
        if self.jump_forward and num_first:
            self._pin_forced(step, num_first)
        lane = step.lane_of_row  # sampling parameters were written into the lanes at admission
        assert lane is not None and step.row_of_logit is not None  # by stage()
        if step.drafts:
            lane = lane[step.row_of_logit]
        num_random, filter_rows = stage_sampling(host, self.lanes, lane)
        heads = self.heads
        num_region = regions.stage_kinds(step.rows, host.kinds, host.region_rows) if heads is not None else 0
        top = step.top_logprobs = int(self.lanes.logprobs[lane].max())
        shape = SampleShape(num_rows, num_random, num_masked, filter_rows, num_region, top)
        region_logprobs = self.region_logprobs
        self.device.run("sample", lambda: device_jobs.sample(slot, shape, heads, region_logprobs))
        return top

    def _fill_masks(self, step: Step) -> tuple[int, int]:
        """Fill the masks of the step's live constrained rows; returns how many rows' first logit
        rows were filled, and how many mask rows in all (a verify row's drafts come after them all).

        One batched call normally, over the rows whose matcher does not fill its own mask; those
        come last in the mask buffers and fill their own rows (MASKS). If that raises, each matcher
        is asked alone: the ones that fail end their request with ERROR (their row allows every
        token; as zombies their token is dropped), and the others keep their masks: one broken
        grammar never fails its neighbours.
        """
        batched: list[tuple[int, Sequence]] = []
        own: list[tuple[int, Sequence]] = []
        for row, seq in enumerate(step.rows):  # one pass: the native call's rows first, OwnMask rows last
            if seq.matcher is not None and not seq.finalized and row not in step.partial:
                (own if seq.own_mask else batched).append((row, seq))
        if not batched and not own:
            return 0, 0
        rows, seqs = zip(*(batched + own), strict=True)
        host, bitmask = step.slot.np, step.slot.host.bitmask
        host.bitmask[: len(rows)] = 0
        assert step.logit_start is not None  # by stage()
        # a mask belongs to its row's first logit row (the row itself in a step without drafts)
        host.mask_rows[: len(rows)] = step.logit_start[list(rows)] if step.drafts else rows
        try:
            if batched:
                matchers = [seq.matcher for _, seq in batched if seq.matcher is not None]  # all: the filter above
                self.fill_masks(matchers, bitmask[: len(batched)])
            for index in range(len(batched), len(seqs)):
                seqs[index].matcher.fill_mask(bitmask, index)
        except Exception:
            for index, seq in enumerate(seqs):
                try:
                    self._fill_one(seq, bitmask, index)
                except Exception as error:
                    host.bitmask[index] = -1
                    self.sequences.finish(seq, FinishReason.ERROR, f"the grammar failed to give a mask: {error}")
        num_masked = len(rows)
        if step.drafts:
            for row, seq in zip(rows, seqs, strict=True):
                if row in step.drafts and not seq.finalized:
                    num_masked = self._fill_draft_masks(step, row, seq, num_masked)
        return len(rows), num_masked

    def _fill_draft_masks(self, step: Step, row: int, seq: Sequence, index: int) -> int:
        """The masks of a verify row's draft positions, from mask row `index` on; returns the next.

        Position i's mask is the matcher's after the drafts d1..di, committed tentatively and rolled
        back. Past a draft the grammar refuses (the committed sample differed from the guess the
        drafts followed), positions allow every token: the sample before them cannot equal the
        refused draft, so none of them is ever accepted.
        """
        host, bitmask, matcher = step.slot.np, step.slot.host.bitmask, seq.matcher
        guesses = step.drafts[row]
        assert matcher is not None and seq.rollback is not None  # a constrained row that drafts (can_draft)
        assert step.logit_start is not None  # by stage()
        first, end = int(step.logit_start[row]), index + len(guesses)
        host.mask_rows[index:end] = np.arange(first + 1, first + 1 + len(guesses))
        host.bitmask[index:end] = -1
        jumps = self.jump_forward and seq.forced_tokens is not None
        committed = 0
        try:
            for position, token in enumerate(guesses):
                matcher.commit(token)
                committed += 1
                if jumps and _would_jump(seq):  # (JUMPS) this position's sample must not be committed
                    del guesses[position:]  # so no draft from d(position + 1) on is accepted
                    break
                host.bitmask[index + position] = 0
                self._fill_one(seq, bitmask, index + position)
        except Exception as error:
            if committed == position + 1:  # the commit went through: the mask failed
                host.bitmask[index + position] = -1
                self.sequences.finish(seq, FinishReason.ERROR, f"the grammar failed to give a mask: {error}")
        finally:
            if committed:
                seq.rollback(committed)
        return end

    def _fill_one(self, seq: Sequence, bitmask: torch.Tensor, index: int) -> None:
        assert seq.matcher is not None  # a constrained row's
        if seq.own_mask:
            seq.matcher.fill_mask(bitmask, index)
        else:
            self.fill_masks([seq.matcher], bitmask[index : index + 1])

    def _pin_forced(self, step: Step, num_masked: int) -> None:
        """Jump-forward (module docstring): narrow the masks of rows whose grammar forces >= 2 tokens
        to the first, and pin the forced tokens for the next launch; a forced run that completes the
        output (FINAL RUNS) is pinned too, whatever its length, and the row gets no launch after it."""
        host = step.slot.np
        assert step.row_of_logit is not None and step.logit_start is not None  # by stage()
        budget = self.scheduler.max_step_tokens - step.num_rows  # the next step's running rows need one token each
        for index in range(num_masked):
            row = int(step.row_of_logit[host.mask_rows[index]])
            seq = step.rows[row]
            if seq.finalized or seq.forced_tokens is None:
                continue
            assert seq.ends_after is not None  # set with forced_tokens
            # F starts at this row's first output index, num_scheduled - 1 (less a verify row's
            # drafts, which it counts), and must end below max_tokens
            scheduled = seq.num_scheduled
            if row in step.drafts:
                scheduled -= int(step.logit_start[row + 1] - step.logit_start[row]) - 1
            forced = seq.forced_tokens()[: min(seq.max_tokens - scheduled + 1, MAX_JUMP)]
            final = bool(forced) and seq.ends_after(forced)
            if not final:  # the sample after F must stay below max_tokens, and F fit the next step
                forced = forced[: min(seq.max_tokens - scheduled, budget + 1)]
                if len(forced) < 2:
                    continue
            if not _narrow(host.bitmask[index], forced[0]):
                continue  # the row's own mask (a composite matcher's narrowing) refuses f0: no jump
            step.pinned[row] = forced
            if final:
                seq.final_run = True
                self.stats.final_runs += 1
            else:
                seq.jump = forced
                budget -= len(forced) - 1
                self.stats.jumps += 1

    # ---- 4. text ------------------------------------------------------------------------------
    def text(self, committed: Committed) -> None:
        if committed:
            started = time.perf_counter()
            self.sequences.stream(committed)
            self._span("text", started)

    # ---- shutdown -----------------------------------------------------------------------------
    def drain(self, reason: FinishReason, error: str | None = None) -> None:
        """Finish every sequence and drop the steps in flight, so every page, lane and slot comes back."""
        self.sequences.finish_all(reason, error)
        with contextlib.suppress(Exception):  # a failed device has nothing more to deliver
            self.device.synchronize()
        while self.inflight:  # every sequence is finalized now: each step is zombies only
            step = self.inflight.popleft()
            for seq in step.rows:
                seq.inflight_refs -= 1
                if seq.inflight_refs == 0:
                    self.scheduler.release(seq)
            step.slot.sampled_host.fill_(POISON)
            step.slot.state, step.slot.step, step.slot.event = SlotState.FREE, None, None

    def _wait_device(self) -> None:
        started = time.perf_counter()
        self.device.synchronize()
        self._span("wait", started)

    def _hook(self, phase: str) -> None:
        if self.debug_hook is not None:
            self.debug_hook(phase)

    def _span(self, name: str, started: float) -> None:
        ended = time.perf_counter()
        self.stats.phase_s[name] += ended - started
        self.trace.span(name, "scheduler", started, ended)


def check_speculative(speculative: str | None, runner: ModelRunner, region_heads: bool) -> str | None:
    """The validated `speculative` setting; raises ValueError, saying what to do, for one this runner cannot run."""
    if speculative is None:
        return None
    if speculative != "ngram":
        raise ValueError(f"speculative must be None (off) or 'ngram' (prompt-lookup drafts), got {speculative!r}")
    if region_heads or not shares_pages(runner):
        raise ValueError(
            f"speculative='ngram' needs a runner whose rows may read the K/V other rows of a launch write "
            f"(runner.SharedPages) and that samples no region values; {type(runner).__name__} is not one: "
            "load it with speculative=None"
        )
    if not getattr(runner, "verify_rows_exact", True):  # declared by a runner whose kernels round them apart
        warnings.warn(
            f"speculative='ngram' on {type(runner).__name__}: its kernels compute a draft's positions in one "
            "launch with other rounding than one at a time, so greedy text can differ from decoding without "
            "drafts where two tokens nearly tie (docs/performance.md); load with speculative=None for text "
            "equal to it",
            stacklevel=4,
        )
    return speculative


def _would_jump(seq: Sequence) -> bool:
    """Whether finalize may pin a forced run at the matcher's current state (`Pipeline._pin_forced`:
    two forced tokens or more, or any that complete the output): a superset of the states it pins at."""
    assert seq.forced_tokens is not None and seq.ends_after is not None  # callers check forced_tokens
    forced = seq.forced_tokens()
    return len(forced) > 1 or (len(forced) == 1 and seq.ends_after(forced))


def _narrow(mask: np.ndarray, token: int) -> bool:
    """Leave `token` the only allowed one in an int32 bitmask row; False (row untouched) if it was not allowed."""
    if not (int(mask[token >> 5]) >> (token & 31)) & 1:
        return False
    bit = 1 << (token & 31)
    mask[:] = 0
    mask[token >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit
    return True
