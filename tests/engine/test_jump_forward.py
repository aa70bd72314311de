"""Jump-forward decoding under the two-slot pipeline (engine/pipeline.py, JUMP-FORWARD), stepped by
hand over a device that runs jobs only when waited on: the pinned sample, the launch that carries
the forced tokens, zombies, caps, and the same outputs in pipelined and blocking mode."""

from __future__ import annotations

import random

import pytest

from foveal.engine.request import FinishReason
from foveal.testing import FakeRunner
from tests.engine.test_pipeline_steps import EOS, VOCAB, add, assert_idle_and_free, make_pipeline, run_to_idle


@pytest.fixture
def Forcing(h):
    class Forcing(h.TrieMatcher):
        """A trie grammar that reports what it forces: the continuation all live options share
        (EOS included when every live option ends here)."""

        def forced_tokens(self) -> list[int]:
            forced, tokens = [], list(self.tokens)
            while True:
                n = len(tokens)
                live = [o for o in self.options if o[:n] == tokens and len(o) >= n]
                nexts = {o[n] if len(o) > n else self.eos for o in live}
                if len(nexts) != 1 or self.eos in tokens:
                    return forced
                (token,) = nexts
                forced.append(token)
                if token == self.eos:
                    return forced
                tokens.append(token)

        def ends_after(self, tokens: list[int]) -> bool:
            return bool(tokens) and tokens[-1] == self.eos and self.tokens + tokens[:-1] in self.options

    return Forcing


def jf_pipeline(pipelined: bool = True, **kwargs):
    kwargs.setdefault("runner", FakeRunner(vocab_size=VOCAB, seed=1))
    return make_pipeline(pipelined, jump_forward=True, **kwargs)


def test_a_pinned_row_samples_f0_and_the_next_launch_carries_the_forced_tokens(Forcing):
    pipe = jf_pipeline()
    options = [[10, 11, 12, 13, 14, 20], [10, 11, 12, 13, 14, 21]]
    seq = add(pipe, [5, 6, 7], max_tokens=10, matcher=Forcing(options), stop=(EOS,), temperature=1.0, seed=3)
    pipe.tick()  # step 0 (prefill): its mask is narrowed to f0 = 10, F pinned for the next launch
    step0 = pipe.inflight[0]
    assert step0.pinned == {0: [10, 11, 12, 13, 14]} and seq.jump == [10, 11, 12, 13, 14]
    mask = step0.slot.np.bitmask[0]
    assert [t for t in range(VOCAB) if (int(mask[t >> 5]) >> (t & 31)) & 1] == [10]
    pipe.tick()  # step 1 launched with the query F (before step 0's commit), then step 0 commits
    step1 = pipe.inflight[0]
    host = step1.slot.np
    assert step1.max_query_len == 5 and step1.num_tokens == 5 and seq.jump is None
    assert host.input_ids[:5].tolist() == [10, 11, 12, 13, 14]
    assert host.positions[:5].tolist() == [3, 4, 5, 6, 7]  # f0 is output 0, at position len(prompt)
    assert host.counters[0] == 5 and seq.num_scheduled == 6  # it samples output 5 (after f4)
    assert seq.token_ids == [10, 11, 12, 13, 14]  # f0 sampled, f1..f4 appended at the same commit
    run_to_idle(pipe)
    out = seq.handle.result(0)
    assert out.finish_reason is FinishReason.STOP and out.token_ids in options
    # prefill, the jump, then 20 or 21 whose only continuation, EOS, is a final run: no zombie ride
    assert pipe.stats.steps == 3  # one token a step: 8 (and a zombie's ride)
    assert pipe.stats.jumps == 1 and pipe.stats.forced_tokens == 4 and pipe.stats.final_runs == 1
    assert_idle_and_free(pipe)


@pytest.mark.parametrize("pipelined", [True, False])
def test_outputs_equal_without_jump_forward_in_fewer_steps(Forcing, pipelined):
    def run(jump: bool):
        pipe = make_pipeline(pipelined, runner=FakeRunner(vocab_size=VOCAB, seed=4), jump_forward=jump)
        rng = random.Random(7)
        seqs = []
        for _ in range(8):
            stem = [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 6))]
            options = [stem + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 4))] for _ in range(3)]
            seqs.append(add(pipe, [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 5))], rng.randint(2, 12),
                            matcher=Forcing(options), stop=(EOS,), seed=rng.randrange(2**64),
                            temperature=rng.choice([0.0, 1.0])))
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        return [(s.handle.result(0).token_ids, s.finish_reason) for s in seqs], pipe.stats

    plain, plain_stats = run(False)
    jumped, jump_stats = run(True)
    assert jumped == plain  # forced tokens are the only ones the masks allow: token for token here
    assert jump_stats.jumps > 0 and jump_stats.decode_rows < plain_stats.decode_rows


def test_pipelined_and_blocking_take_the_same_jumps(Forcing):
    results = []
    for pipelined in (True, False):
        pipe = jf_pipeline(pipelined)
        rng = random.Random(3)
        seqs = [
            add(pipe, [i + 1], max_tokens=rng.randint(3, 15), stop=(EOS,), temperature=1.0, seed=i,
                matcher=Forcing([[i, i + 1, i + 2] + [rng.randrange(1, VOCAB)] * 3 for _ in range(2)]))
            for i in range(1, 7)
        ]
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        results.append(([s.handle.result(0).token_ids for s in seqs], pipe.stats.jumps, pipe.stats.forced_tokens))
    assert results[0] == results[1]


def test_a_jump_never_takes_a_sequence_past_max_tokens(Forcing):
    pipe = jf_pipeline()
    seq = add(pipe, [1, 2], max_tokens=4, matcher=Forcing([list(range(30, 40))]), stop=(EOS,))
    while pipe.has_work():
        pipe.tick()
        assert seq.num_scheduled <= 4
    out = seq.handle.result(0)
    assert out.finish_reason is FinishReason.LENGTH and out.token_ids == [30, 31, 32, 33]
    assert_idle_and_free(pipe)


def test_a_grammar_completing_inside_the_jump_leaves_a_zombie_row(h, Forcing):
    class NoEnd(Forcing):
        def ends_after(self, tokens):
            return False  # cannot tell whether a forced run completes the output: says no (matcher.py)

    pipe = jf_pipeline()
    seq = add(pipe, [1], max_tokens=20, matcher=NoEnd([[40, 41, 42]]), stop=(EOS,))
    pipe.tick()  # step 0 pins [40, 41, 42, EOS]
    assert seq.jump == [40, 41, 42, EOS] and not seq.final_run
    pipe.tick()  # step 1 carries the jump; step 0 commits 40, 41, 42 and EOS: finished, step 1 a zombie
    assert seq.finalized and seq.finish_reason is FinishReason.STOP and seq.inflight_refs == 1
    assert seq.handle.result(0).token_ids == [40, 41, 42]
    run_to_idle(pipe)
    assert seq.released
    assert_idle_and_free(pipe)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_final_run_gets_no_launch_after_it(Forcing, pipelined):
    """FINAL RUNS: the forced run [40, 41, 42, EOS] completes the output, so no launch carries it."""
    pipe = jf_pipeline(pipelined)
    seq = add(pipe, [1], max_tokens=20, matcher=Forcing([[40, 41, 42]]), stop=(EOS,))
    other = add(pipe, [2, 3], max_tokens=5)
    pipe.tick()  # step 0 (prefill of both) pins the final run
    assert not pipelined or pipe.inflight[0].pinned == {0: [40, 41, 42, EOS]}
    assert seq.jump is None and (seq.final_run or seq.finalized)
    pipe.tick()  # step 1 carries `other` alone; step 0 commits the run: finished and released at once
    step1 = pipe.inflight[0] if pipelined else None
    assert step1 is None or step1.rows == [other]
    assert seq.finalized and seq.finish_reason is FinishReason.STOP and seq.released
    assert seq.handle.result(0).token_ids == [40, 41, 42]
    run_to_idle(pipe)
    assert other.finish_reason is FinishReason.LENGTH and pipe.stats.final_runs == 1
    assert pipe.stats.decode_rows == 4  # other's four decode steps; seq rode in none
    assert_idle_and_free(pipe)


def test_a_final_run_never_passes_max_tokens(Forcing):
    pipe = jf_pipeline()
    seq = add(pipe, [1], max_tokens=3, matcher=Forcing([[40, 41, 42]]), stop=(EOS,))
    pipe.tick()  # [40, 41, 42, EOS] would end at output index 3: not a final run, a jump of two
    assert not seq.final_run and seq.jump == [40, 41]
    run_to_idle(pipe)
    out = seq.handle.result(0)
    assert out.finish_reason is FinishReason.LENGTH and out.token_ids == [40, 41, 42]
    assert_idle_and_free(pipe)


def test_a_final_run_that_does_not_end_fails_its_request_and_never_hangs(Forcing):
    class Wrong(Forcing):
        def ends_after(self, tokens):
            return True  # says every forced run completes the output

    pipe = jf_pipeline()
    seq = add(pipe, [1], max_tokens=20, matcher=Wrong([[40, 41, 42, 43, 50], [40, 41, 42, 43, 51]]), stop=(EOS,))
    run_to_idle(pipe)
    out = seq.handle.result(0)
    assert out.finish_reason is FinishReason.ERROR and "did not" in out.error
    assert out.token_ids == [40, 41, 42, 43]
    assert_idle_and_free(pipe)


@pytest.mark.parametrize("pipelined", [True, False])
def test_cancel_between_the_pin_and_the_jump_frees_everything(Forcing, pipelined):
    pipe = jf_pipeline(pipelined)
    seq = add(pipe, [1, 2, 3], max_tokens=20, matcher=Forcing([[50, 51, 52, 53, 60], [50, 51, 52, 53, 61]]))
    other = add(pipe, [4], max_tokens=6)
    pipe.tick()
    assert seq.jump is not None or not pipelined
    pipe.sequences.cancel(seq.id)
    run_to_idle(pipe)
    assert seq.finish_reason is FinishReason.CANCELLED and other.finish_reason is FinishReason.LENGTH
    assert_idle_and_free(pipe)


def test_no_jump_where_the_rows_mask_refuses_the_first_forced_token(h):
    class Lying(h.TrieMatcher):
        def forced_tokens(self):
            return [99, 98, 97]  # not what the mask allows

        def ends_after(self, tokens):
            return False

    pipe = jf_pipeline()
    seq = add(pipe, [1], max_tokens=10, matcher=Lying([[7, 8, 9]]), stop=(EOS,))
    run_to_idle(pipe)
    assert seq.handle.result(0).token_ids == [7, 8, 9] and pipe.stats.jumps == 0
    assert_idle_and_free(pipe)


def test_jumps_are_capped_so_the_next_steps_rows_fit_max_step_tokens(Forcing):
    pipe = jf_pipeline(max_step_tokens=8)
    options = [list(range(100, 110)) + [end] for end in (120, 121)]  # F = 100..109 does not end the output
    seqs = [add(pipe, [i], max_tokens=20, matcher=Forcing(options), stop=(EOS,)) for i in (1, 2)]
    pipe.tick()  # two prefill rows: the next step's running rows may add 8 - 2 = 6 forced tokens
    pinned = pipe.inflight[0].pinned
    assert sum(len(f) - 1 for f in pinned.values()) <= 6 and pinned
    run_to_idle(pipe)
    assert all(s.handle.result(0).token_ids in options for s in seqs)
    assert_idle_and_free(pipe)
