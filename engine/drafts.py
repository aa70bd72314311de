"""Drafts for speculative decoding: prompt lookup over a sequence's own context, and when to draft.

PROBLEM
    At a few rows a step a forward is bound by reading the weights, so checking several guessed
    tokens in one forward costs little more than producing one (pipeline.py, SPECULATIVE
    DECODING). Structured answers copy from their input (a name, an address, an order number from
    a document) and free text repeats itself; guesses must come from there, with no draft model,
    and cost the host microseconds. A wrong guess is not free: its verify step sits one launch out
    of the pipeline, so a sequence whose guesses keep failing must stop guessing.
SOLUTION
    `PromptLookup` indexes a sequence's context (prompt + committed output) by bigram as tokens are
    committed. `propose(n)` takes the latest earlier occurrences of the context's last two tokens,
    extends each match backwards, and returns the continuation (n tokens) of the longest match, if
    that match is at least `min_match` tokens long (ties: the most recent); with `min_match` 1 and
    no bigram, the latest earlier occurrence of the last token. A match that reaches the
    context's end (a repeated run) is continued with the period it found.
    `Drafter` wraps it with a per-sequence back-off: a verify step that accepts no draft doubles
    the number of later launches that carry none (1, 2, 4, ... up to `MAX_BACKOFF`); one that
    accepts any resets it.
INVARIANTS
    - A proposal is a pure function of the context and the sequence's past verdicts: never of the
      batch it rides in, the sampling seed or the device.
    - `propose` returns [] or tokens that follow an earlier occurrence of the context's last
      `min_match` (or more) tokens; the index only ever grows with the context.
    - `probe` leaves the matcher exactly as it found it (commits are rolled back), and counts no
      token past a state its `stop` holds in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Tokens one verify row guesses at most (MAX_LAUNCH_ROWS caps it further in steps of several rows).
# A verify row's positions are rows of a decode launch, whose cost grows with its rows beyond a
# few, so long guesses cost more than the rare long acceptance pays back.
MAX_DRAFT = 3
# A step with drafts is launched with at most this many rows (logit rows, drafts included), so a
# step of as many rows carries none. A forward over many rows reads the weights once for all of
# them already, so extra positions cost compute there rather than ride along; few rows keep the
# kernels a batch-1 decode runs (quantized runners switch kernels with the row count, and a
# position's logits should not depend on whether it was guessed: quant.SplitLinear runs its int4
# kernel up to quant.FEW_ROWS = 4 rows, and this must not exceed it).
MAX_LAUNCH_ROWS = 4
# The shortest match that may propose (docs/speculative.md has the measurement): a match of 3
# tokens drafts least, and a single token drafts for free text guesses that fail 4 times in 5.
MIN_MATCH = 2
MAX_CANDIDATES = 8  # latest occurrences of the last bigram that are extended per proposal
MAX_MATCH_SCAN = 32  # a match longer than this is as good as any longer one
MAX_BACKOFF = 32  # launches without drafts after repeated rejections, at most


class PromptLookup:
    """One sequence's context, indexed by bigram (position of the second token of each occurrence)
    and, for matches of one token, by token (its latest position)."""

    __slots__ = ("tokens", "index", "latest", "num_prompt")

    def __init__(self, prompt: list[int]) -> None:
        self.tokens: list[int] = []
        self.index: dict[tuple[int, int], list[int]] = {}
        self.latest: dict[int, int] = {}
        self.num_prompt = len(prompt)
        self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        context, index, latest = self.tokens, self.index, self.latest
        for token in tokens:
            if context:
                index.setdefault((context[-1], token), []).append(len(context))
                latest[context[-1]] = len(context) - 1  # the context's last token is never its own match
            context.append(token)

    def sync(self, output: list[int]) -> None:
        """Take in the output tokens committed since the last call (`output`: all of them so far)."""
        seen = len(self.tokens) - self.num_prompt
        if len(output) > seen:
            self.extend(output[seen:])

    def propose(self, n: int, min_match: int = MIN_MATCH) -> list[int]:
        """The continuation (<= n tokens) of the longest earlier match of the context's end; [] if none."""
        context = self.tokens
        last = len(context) - 1
        if n < 1 or last < 1:
            return []
        ends = self.index.get((context[-2], context[-1])) or ()
        best, best_len = -1, 0
        for end in reversed(ends[-MAX_CANDIDATES - 1 :]):
            if end >= last:  # the context's own end
                continue
            length = 2
            while length < MAX_MATCH_SCAN and end - length >= 0 and context[end - length] == context[last - length]:
                length += 1
            if length > best_len:
                best, best_len = end, length
        if best < 0 and min_match <= 1:  # no bigram: the latest earlier occurrence of the last token
            best, best_len = self.latest.get(context[-1], -1), 1
        if best < 0 or best_len < min_match:
            return []
        # A match that reaches into the context's end (a repeated run: "0000", "ab-ab-") has fewer
        # than n tokens after it; the run goes on with the period the match found (last - best).
        out = context[best + 1 : best + 1 + n]
        while len(out) < n:
            out.append(out[len(out) - (last - best)])
        return out


class Drafter:
    """A sequence's drafts: prompt lookup plus its back-off after rejections."""

    __slots__ = ("lookup", "failures", "skip")

    def __init__(self, prompt: list[int]) -> None:
        self.lookup = PromptLookup(prompt)
        self.failures = 0
        self.skip = 0  # launches left that carry no drafts

    def propose(self, output: list[int], n: int) -> list[int]:
        """Up to n draft tokens after the context prompt + `output`, or [] (none found, or backing off)."""
        if self.skip:
            self.skip -= 1
            return []
        self.lookup.sync(output)
        return self.lookup.propose(n, MIN_MATCH)

    def verdict(self, accepted: int) -> None:
        """A verify step accepted `accepted` of its drafts."""
        if accepted:
            self.failures = 0
            return
        self.skip = min(1 << self.failures, MAX_BACKOFF)
        self.failures += 1


def probe(
    commit: Callable[[int], None],
    rollback: Callable[[int], None],
    tokens: list[int],
    stop: Callable[[], bool] | None = None,
    start: int = 0,
) -> int:
    """How many leading `tokens` a matcher accepts, committed one by one and then rolled back.

    `stop`, a test of the matcher's current state, ends the count earlier: the count c is then the
    largest for which no state after j tokens, start <= j <= c, is one `stop` holds in (less than
    `start` when the state after `start` tokens is one). The pipeline stops drafts where the
    grammar forces a run that decoding without drafts would jump over (`Pipeline._plan_drafts`).
    """
    count = 0
    try:
        if stop is not None and start == 0 and stop():
            return 0
        for token in tokens:
            commit(token)
            count += 1
            if stop is not None and count >= start and stop():
                return count - 1
    except Exception:  # the first token the grammar refuses ends the draft
        pass
    finally:
        if count:
            rollback(count)
    return count


@dataclass(slots=True)
class DraftStats:
    """Counts of the pipeline's speculative work since the last reset: where drafts come from and
    where they are lost (per decode row the planner looked at, then per draft token)."""

    backed_off: int = 0  # rows that sat a launch out of drafting after rejections (`Drafter` back-off)
    capped: int = 0  # rows with no room for a draft (max_tokens, the step's rows, the row's KV page)
    lookups: int = 0  # rows whose context was looked up
    no_match: int = 0  # of those, lookups that found no continuation
    proposed: int = 0  # draft tokens the lookups proposed (past the guess of a sample in flight)
    cut: int = 0  # of those, cut by the grammar (refused, or where it forces a run) before launch
    verify_rows: int = 0  # rows that carried drafts
    drafted: int = 0  # draft tokens launched
    accepted: int = 0  # of those, accepted
    rejected: int = 0  # verify rows that accepted none of their drafts

    def summary(self) -> dict[str, float]:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {name: getattr(self, name) for name in self.__slots__} | {"rate": rate}
