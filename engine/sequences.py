"""The live sequences and what ends them: appending a committed token, stops, text, finishing.

PROBLEM
    At commit each sampled token must be checked against everything that can end its sequence
    (its grammar refusing it, EOS and stop ids, the grammar completing, max_tokens, a stop string)
    and the caller must see text deltas and one final output. Only what the next masks depend on
    may sit between commit t and sample t+1; text can wait until after finalize.
SOLUTION
    `append` (commit) does the stops that need no text: matcher, stop ids, grammar end, max_tokens.
    `stream` (the text phase, after finalize) detokenizes, finds stop strings and pushes deltas.
    `finish` ends a sequence once: it becomes `finalized` (a zombie while steps in flight still
    carry it), leaves the scheduler's queues, and its pages go back when `inflight_refs` is 0.
INVARIANTS
    - A sequence finishes exactly once; every delta is pushed before its final output.
    - EOS / stop ids and a finalized sequence's later tokens are never part of the output.
    - `release` runs once per sequence, when it is finalized and no step in flight carries it.
"""

from __future__ import annotations

import time

from .request import FinishReason, RequestOutput, Timings, TokenLogprob
from .scheduler import Scheduler
from .sequence import Sequence
from .stats import Stats


class Sequences:
    def __init__(self, scheduler: Scheduler, stats: Stats) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.live: dict[int, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.live[seq.id] = seq
        self.scheduler.waiting.append(seq)

    def cancel(self, request_id: int) -> None:
        seq = self.live.get(request_id)
        if seq is not None:
            self.finish(seq, FinishReason.CANCELLED)

    def append(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Commit one token; finish the sequence on a stop that needs no text. True: its text is due.

        `logprob`: the sampler's record of the token, for a sequence that asked for logprobs; None
        for a token forced without a forward (its logprob under the grammar's mask is 0.0).
        """
        if not seq.num_committed:  # its first token: the end of its prefill (Timings)
            seq.first_token_s = time.perf_counter()
        seq.num_committed += 1
        self.stats.tokens += 1
        matcher = seq.matcher
        if matcher is not None:
            try:
                matcher.commit(token)
            except Exception as error:  # the request fails; the engine carries on
                self.finish(seq, FinishReason.ERROR, f"the grammar refused token {token}: {error}")
                return False
        if token in seq.stop_ids:
            self.finish(seq, FinishReason.STOP)
            return False
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprob if logprob is not None else TokenLogprob(token, 0.0))
        terminated = matcher is not None and matcher.is_terminated()
        if terminated or seq.num_committed >= seq.max_tokens:
            seq.detok.add(token)  # its final text; a stop string in it makes the reason STOP
            stop = terminated or seq.detok.stopped
            self.finish(seq, FinishReason.STOP if stop else FinishReason.LENGTH)
            return False
        return True

    def stream(self, committed: list[tuple[Sequence, int]]) -> None:
        """Detokenize committed tokens, end sequences on stop strings, push text deltas."""
        for seq, token in committed:
            if seq.finalized:  # cancelled between its commit and now
                continue
            detok = seq.detok
            detok.add(token)
            if detok.stopped:
                self.finish(seq, FinishReason.STOP)
            elif delta := detok.release(final=False):
                seq.handle._push(delta)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        seq.finalized = True
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seq.detok.flush()
        if delta := seq.detok.release(final=True):
            seq.handle._push(delta)
        del self.live[seq.id]
        logprobs = list(seq.logprobs) if seq.logprobs is not None else None
        timings = Timings.of(seq.submitted_s, seq.admitted_s, seq.first_token_s, time.perf_counter())
        output = RequestOutput(list(seq.token_ids), seq.detok.text, reason, seq.prompt_len, error, logprobs, timings)
        if seq.inflight_refs == 0:
            self.scheduler.release(seq)
        seq.handle._finish(output)

    def finish_all(self, reason: FinishReason, error: str | None = None) -> None:
        for seq in list(self.live.values()):
            self.finish(seq, reason, error)
