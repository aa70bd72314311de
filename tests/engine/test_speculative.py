"""Speculative decoding (engine/pipeline.py, SPECULATIVE DECODING; engine/drafts.py), stepped by hand
over a device that runs jobs only when waited on.

The runner is FakeRunner(window=1): its logits depend on the last token only, so greedy (and
low-temperature) text soon repeats itself and prompt lookup finds drafts that are accepted, while
the runner still checks every KV page, position and gathered id (a wrong one changes the logits).
"""

from __future__ import annotations

import random

import pytest

from foveal.engine.drafts import Drafter, PromptLookup, probe
from foveal.engine.request import FinishReason
from foveal.engine.step import Step
from foveal.testing import FakeRunner
from tests.engine.test_pipeline_steps import (
    EOS,
    VOCAB,
    add,
    assert_greedy,
    assert_idle_and_free,
    make_pipeline,
    run_to_idle,
)


def spec_pipeline(pipelined: bool = True, speculative: str | None = "ngram", **kwargs):
    kwargs.setdefault("runner", FakeRunner(vocab_size=VOCAB, seed=2, window=1))
    kwargs.setdefault("max_batch", 8)
    return make_pipeline(pipelined, speculative=speculative, **kwargs)


def random_requests(pipe, n: int, seed: int, temperature: float = 0.0, matcher=None, stop=()):
    rng = random.Random(seed)
    return [
        add(pipe, [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))], rng.randint(2, 40), seed=i,
            temperature=temperature, matcher=matcher(rng) if matcher else None, stop=stop)
        for i in range(n)
    ]


def outputs(seqs) -> list:
    return [(s.handle.result(0).token_ids, s.handle.result(0).finish_reason) for s in seqs]


# ---- drafts ---------------------------------------------------------------------------------------


def test_prompt_lookup_proposes_the_continuation_of_the_longest_earlier_match():
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # [1, 2, 3] occurred at the start (continued by 4, 5); [2, 3] alone later (continued by 7)
    assert lookup.propose(3) == [4, 5, 9]
    assert lookup.propose(3, min_match=4) == []  # the longest match is 3 tokens
    assert PromptLookup([5, 6, 7, 8]).propose(4) == []  # nothing repeats
    lookup.extend([4])
    assert lookup.propose(2) == [5, 9]


def test_a_match_that_reaches_the_contexts_end_goes_on_with_its_period():
    """A repeated run ("0000", "ab-ab-") has fewer tokens after its latest match than asked for:
    the proposal repeats the run instead of stopping short."""
    assert PromptLookup([9, 0, 0, 0]).propose(3) == [0, 0, 0]
    assert PromptLookup([4, 1, 2, 3, 1, 2, 3, 1, 2]).propose(4) == [3, 1, 2, 3]


def test_a_one_token_match_proposes_only_when_asked_and_only_without_a_longer_one():
    lookup = PromptLookup([5, 1, 9, 9, 2, 7, 1])
    assert lookup.propose(3) == []  # no earlier bigram (7, 1)
    assert lookup.propose(3, min_match=1) == [9, 9, 2]  # the latest earlier 1
    lookup.extend([9])
    assert lookup.propose(2, min_match=1) == [9, 2]  # the bigram (1, 9) wins over the later lone 9


def test_a_drafter_backs_off_after_rejections_and_recovers_on_acceptance():
    drafter = Drafter([1, 2, 3, 1, 2, 3, 1, 2])
    assert drafter.propose([], 2) == [3, 1]
    drafter.verdict(0)
    assert drafter.propose([], 2) == []  # one launch without drafts
    assert drafter.propose([], 2) == [3, 1]
    drafter.verdict(0)
    assert [drafter.propose([], 2) for _ in range(3)] == [[], [], [3, 1]]  # then two
    drafter.verdict(1)
    assert drafter.propose([], 2) == [3, 1]


def test_probe_counts_the_accepted_tokens_and_leaves_the_matcher_as_it_was(h):
    matcher = h.TrieMatcher([[5, 6, 7, 8]])
    matcher.commit(5)
    assert probe(matcher.commit, matcher.rollback, [6, 7, 9, 8]) == 2
    assert matcher.tokens == [5]


# ---- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_outputs_are_token_identical_to_decoding_without_drafts_in_fewer_steps(pipelined, temperature):
    results = []
    for speculative in (None, "ngram"):
        pipe = spec_pipeline(pipelined, speculative)
        seqs = random_requests(pipe, 6, seed=4, temperature=temperature)
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        results.append((outputs(seqs), pipe.stats.steps, pipe.draft_stats))
    (plain, plain_steps, _), (drafted, steps, stats) = results
    assert drafted == plain
    assert stats.accepted > 0 and steps < plain_steps


def test_pipelined_and_blocking_give_the_same_tokens_with_drafts():
    results = []
    for pipelined in (True, False):
        pipe = spec_pipeline(pipelined)
        seqs = random_requests(pipe, 7, seed=9, temperature=0.5, stop=(EOS,))
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        results.append(outputs(seqs))
    assert results[0] == results[1]


def test_every_accepted_token_is_the_greedy_token_of_its_context():
    pipe = spec_pipeline()
    runner = pipe.runner
    seqs = random_requests(pipe, 4, seed=2)
    run_to_idle(pipe)
    assert pipe.draft_stats.accepted > 0
    assert_greedy(runner, seqs)


# ---- the grammar ----------------------------------------------------------------------------------


class Launch:
    """A launched step, and what it looked like at launch (its slot's buffers are reused later)."""

    def __init__(self, step: Step, seen: dict) -> None:
        self.step, self.drafts, self.rows = step, step.drafts, step.rows
        self.logit_start = step.logit_start.tolist()
        self.counters = step.slot.np.counters[: step.num_logits].tolist()
        self.seen = seen  # row -> (its committed tokens, whether its last sample was in flight)


def recording_launches(pipe) -> list[Launch]:
    launched: list[Launch] = []
    launch, plan = pipe.launch, pipe._plan_drafts
    seen: dict = {}

    def planning(step):
        seen.clear()
        seen.update({r: (list(seq.token_ids), seq.num_scheduled - seq.num_committed) for r, seq in enumerate(step.rows)})
        plan(step)

    def recording():
        step = launch()
        if step is not None:
            launched.append(Launch(step, dict(seen)))
        return step

    pipe.launch, pipe._plan_drafts = recording, planning
    return launched


def test_drafts_the_grammar_forbids_are_never_launched(h):
    """The prompt repeats 1 7 8 9 5 6 10; the grammar allows 7 8 9 5 6 but never 10 after them."""
    pipe = spec_pipeline(runner=FakeRunner(vocab_size=VOCAB, seed=3))
    launches = recording_launches(pipe)
    matcher = h.TrieMatcher([[7, 8, 9, 5, 6, 11], [7, 8, 9, 5, 6, 12]])
    prompt = [1, 7, 8, 9, 5, 6, 10, 3, 1, 7, 8, 9, 5, 6, 10, 4, 1]
    seq = add(pipe, prompt, max_tokens=12, matcher=matcher, stop=(EOS,))
    run_to_idle(pipe)
    out = seq.handle.result(0)
    assert out.finish_reason is FinishReason.STOP and matcher.accepts(out.token_ids)
    verified = [(step.seen[0], step.drafts[0]) for step in launches if 0 in step.drafts]
    assert verified  # after the output's 7 8 the lookup proposes 9 5 6 10 4 ...: cut before 10
    for (committed, in_flight), drafts in verified:
        n = len(committed) + in_flight  # the drafts follow the committed tokens and the sample in flight
        assert 10 not in drafts
        assert any(o[: len(committed)] == committed and o[n : n + len(drafts)] == drafts for o in matcher.options)


def test_masks_at_every_draft_position_follow_the_grammar(h):
    """Constrained outputs stay valid and equal to decoding without drafts, whatever the drafts."""
    results = []
    for speculative in (None, "ngram"):
        pipe = spec_pipeline(speculative=speculative)
        rng = random.Random(5)
        seqs = []
        for i in range(6):
            stem = [rng.randrange(1, 40) for _ in range(3)]
            options = [stem * rng.randint(1, 4) + [rng.randrange(1, VOCAB)] for _ in range(3)]
            seqs.append(add(pipe, stem * 3, max_tokens=30, matcher=h.TrieMatcher(options), stop=(EOS,),
                            seed=i, temperature=rng.choice([0.0, 1.0])))
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        for seq in seqs:
            assert seq.request.matcher.accepts(seq.handle.result(0).token_ids)
        results.append((outputs(seqs), pipe.draft_stats.accepted))
    assert results[0][0] == results[1][0] and results[1][1] > 0


@pytest.mark.parametrize("pipelined", [True, False])
def test_drafts_compose_with_jump_forward(h, pipelined):
    from tests.engine.test_jump_forward import Forcing as forcing_fixture  # noqa: F401 (the fixture's class)

    class Forcing(h.TrieMatcher):
        def forced_tokens(self):
            n, forced = len(self.tokens), []
            live = self._live()
            while live and all(len(o) > n + len(forced) for o in live):
                nexts = {o[n + len(forced)] for o in live}
                if len(nexts) != 1:
                    break
                forced.append(nexts.pop())
            return forced

        def ends_after(self, tokens):
            return False

    results = []
    for speculative in (None, "ngram"):
        pipe = spec_pipeline(pipelined, speculative, jump_forward=True)
        rng = random.Random(8)
        seqs = []
        for i in range(5):
            stem = [rng.randrange(1, 40) for _ in range(4)]
            options = [stem + [rng.randrange(1, VOCAB) for _ in range(3)] + stem for _ in range(2)]
            seqs.append(add(pipe, stem * 2, max_tokens=20, matcher=Forcing(options), stop=(EOS,), seed=i))
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        results.append((outputs(seqs), pipe.stats.jumps))
    assert results[0] == results[1]


def spelled_twice(h):
    """A trie grammar in which one stretch of text has two tokenizations: after `stem` it allows x
    (then y) or z alone (x y and z spell the same text), and reports the canonical x y as forced
    there, as llguidance does; decoding without drafts narrows that position to x and jumps over
    x y (pipeline.py, JUMP-FORWARD), so a verify row that samples it freely may pick z instead."""

    class SpelledTwice(h.TrieMatcher):
        def __init__(self, stem: list[int], x: int, y: int, z: int, tail: list[int]) -> None:
            super().__init__([stem + [x, y] + tail, stem + [z] + tail])
            self.split, self.canonical = stem, [x, y]

        def forced_tokens(self) -> list[int]:
            return list(self.canonical) if self.tokens == self.split else []

        def ends_after(self, tokens: list[int]) -> bool:
            return False

    return SpelledTwice


@pytest.mark.parametrize("pipelined", [True, False])
def test_drafts_never_sample_where_decoding_jumps_over_a_forced_run(h, pipelined):
    """Every forced run is taken where decoding without drafts takes it, with its canonical tokens:
    no logit row of a verify step samples a position where the grammar forces a run."""
    SpelledTwice = spelled_twice(h)
    results = []
    for speculative in (None, "ngram"):
        rng = random.Random(12)
        outs, jumps, accepted = [], 0, 0
        for i in range(8):  # one call at a time: steps of few rows carry drafts
            pipe = spec_pipeline(pipelined, speculative, jump_forward=True)
            stem = [rng.randrange(1, 40) for _ in range(4)]
            x, y, z = rng.sample(range(40, VOCAB), 3)
            seq = add(pipe, stem * 2, max_tokens=20, matcher=SpelledTwice(stem, x, y, z, stem), stop=(EOS,), seed=i)
            run_to_idle(pipe)
            assert_idle_and_free(pipe)
            assert seq.request.matcher.accepts(seq.handle.result(0).token_ids)
            outs += outputs([seq])
            jumps, accepted = jumps + pipe.stats.jumps, accepted + pipe.draft_stats.accepted
        results.append((outs, jumps, accepted))
    (plain, plain_jumps, _), (drafted, jumps, accepted) = results
    assert plain_jumps == 8 and accepted > 0
    assert drafted == plain and jumps == plain_jumps


def test_a_verify_row_whose_guess_was_wrong_is_pinned_where_the_real_sample_forces_a_run(h):
    """Pipelined, a verify row's drafts follow a guess of the sample in flight. When that sample
    differs and leads to a state that forces a run, finalize pins the row as decoding without drafts
    would (narrowed to the run's first token, the run carried next) and its drafts are void."""

    class Forcing(h.TrieMatcher):
        def __init__(self, options, forced):
            super().__init__(options)
            self.forced = forced

        def forced_tokens(self):
            return list(self.forced.get(tuple(self.tokens), []))

        def ends_after(self, tokens):
            return False

    stem, tail = [11, 12, 13, 14], [7, 8, 9]
    probe_runner = FakeRunner(vocab_size=VOCAB, seed=2, window=1)
    a, b = sorted((40, 41), key=lambda t: float(probe_runner.reference_logits(stem)[t]))  # b: the greedy one
    x, z = sorted((50, 51), key=lambda t: float(probe_runner.reference_logits(stem + [b])[t]))  # z preferred to x

    class Guessing(Drafter):
        """Proposes the guess a (and what follows it) once the stem is committed, nothing else."""

        __slots__ = ()

        def propose(self, output, n):
            return [a, *tail][:n] if output == stem else []

    results = []
    for speculative in (None, "ngram"):
        pipe = spec_pipeline(True, speculative, jump_forward=True, runner=FakeRunner(vocab_size=VOCAB, seed=2, window=1),
                             page_size=16, num_pages=16)  # room for drafts in the row's page
        launches = recording_launches(pipe)
        matcher = Forcing([stem + [a] + tail, stem + [b, x, 60] + tail, stem + [b, z] + tail], {tuple(stem + [b]): [x, 60]})
        seq = add(pipe, [1, 2, 3], max_tokens=20, matcher=matcher, stop=(EOS,))
        seq.drafter = Guessing(seq.request.prompt_ids)
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        results.append((outputs([seq]), pipe.stats.jumps))
        voided = [launch for launch in launches if set(launch.drafts) & set(launch.step.pinned)]
        assert bool(voided) == (speculative is not None)
    assert results[0] == results[1]
    assert results[0][0][0][0] == stem + [b, x, 60] + tail


# ---- caps, stops, zombies, pages ------------------------------------------------------------------


def test_no_logit_row_reaches_max_tokens_and_a_step_fits_max_batch():
    pipe = spec_pipeline(max_batch=4)
    launches = recording_launches(pipe)
    seqs = random_requests(pipe, 4, seed=6)
    run_to_idle(pipe)
    assert any(step.drafts for step in launches)
    for step in launches:
        assert step.logit_start[-1] <= 4  # the slot's sampling buffers hold max_batch logit rows
        for row, seq in enumerate(step.rows):
            first, last = step.logit_start[row], step.logit_start[row + 1]
            assert step.counters[first:last] == list(range(step.counters[first], step.counters[last - 1] + 1))
            assert step.counters[last - 1] < seq.max_tokens
    assert all(len(s.handle.result(0).token_ids) == s.max_tokens for s in seqs)
    assert_idle_and_free(pipe)


def test_eos_inside_accepted_drafts_ends_the_output_there():
    def run(speculative):
        pipe = spec_pipeline(speculative=speculative, runner=FakeRunner(vocab_size=VOCAB, seed=2, window=1,
                                                                          boost={EOS: 2.0}))
        seqs = random_requests(pipe, 8, seed=11, stop=(EOS,))
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        return outputs(seqs), pipe.draft_stats.accepted

    plain, _ = run(None)
    drafted, accepted = run("ngram")
    assert drafted == plain and accepted > 0
    assert any(reason is FinishReason.STOP for _, reason in plain)


def test_sitting_out_after_a_verify_step_then_coming_back_from_the_host():
    pipe = spec_pipeline()
    seq = add(pipe, [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=30)
    launches = recording_launches(pipe)
    while pipe.has_work() and not any(step.drafts for step in launches):
        pipe.tick()
    verify = launches[-1]
    assert verify.drafts and seq.verifying
    pipe.tick()  # the next launch cannot know how many drafts commit: seq sits it out
    assert launches[-1] is verify or seq not in launches[-1].rows
    assert not seq.verifying and seq.jump is not None and len(seq.jump) == 1
    pipe.tick()  # back, its input (the last token the verify step sampled) from the host
    back = launches[-1]
    assert seq in back.rows and seq.jump is None
    run_to_idle(pipe)
    assert_idle_and_free(pipe)


@pytest.mark.parametrize("pipelined", [True, False])
def test_cancel_during_a_verify_step_frees_every_page_once(pipelined):
    pipe = spec_pipeline(pipelined)
    seq = add(pipe, [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=30)
    other = add(pipe, [9, 8], max_tokens=12)
    launches = recording_launches(pipe)
    while pipe.has_work() and not any(step.drafts for step in launches):
        pipe.tick()
    assert launches[-1].drafts
    pipe.sequences.cancel(seq.id)  # its verify step is in flight (pipelined) or committed (blocking)
    assert seq.finalized
    run_to_idle(pipe)
    assert seq.finish_reason is FinishReason.CANCELLED and seq.released
    assert other.finish_reason is FinishReason.LENGTH
    assert pipe.pool.frees > 0
    assert_idle_and_free(pipe)


def test_no_drafts_in_a_step_with_many_decode_rows():
    from foveal.engine import drafts

    pipe = spec_pipeline(max_batch=16)
    launches = recording_launches(pipe)
    seqs = [add(pipe, [5, 6, 7, 5, 6, 7, 5, 6 + i], max_tokens=12 + 4 * i) for i in range(drafts.MAX_LAUNCH_ROWS + 1)]
    run_to_idle(pipe)
    assert any(step.drafts for step in launches)  # once few are left
    for launch in launches:
        assert not launch.drafts or launch.logit_start[-1] <= drafts.MAX_LAUNCH_ROWS
        assert not launch.drafts or len(launch.rows) < drafts.MAX_LAUNCH_ROWS
    assert all(seq.finish_reason is FinishReason.LENGTH for seq in seqs)
    assert_idle_and_free(pipe)


def test_a_runner_whose_rows_cannot_share_pages_is_refused():
    class LastOnly(FakeRunner):
        rows_share_pages = False

    with pytest.raises(ValueError, match="speculative=None"):
        spec_pipeline(runner=LastOnly(vocab_size=VOCAB))
    with pytest.raises(ValueError, match="'ngram'"):
        spec_pipeline(speculative="eagle")
