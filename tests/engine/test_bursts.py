"""Decode bursts (engine/bursts.py): every invariant of its docstring, the pipeline stepped by hand
over a device that runs jobs only when waited on, and through the Engine.

FakeRunner checks every position, KV slot and gathered id (a wrong one changes its logits), so a
burst that stages a sub-step wrongly gives other tokens than decoding one token a step."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from foveal.engine import Engine, FinishReason, Request, SamplingParams
from foveal.engine.bursts import Burst
from foveal.engine.pipeline import Pipeline
from foveal.engine.runner import Continues, ForwardBatch
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


class ContinuingRunner(FakeRunner):
    """FakeRunner with `runner.Continues`: `forward_next` rebuilds the launch after its last one (each
    row one position on, its K/V slot from the block tables it is given) and runs it as a batch, so
    a continuation that names another position, page or input than the batch would gives other tokens."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # positions, contexts of a continuable launch
        self.continued = 0

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.last = None
        logits = super().forward(batch)
        if batch.input_ids.shape[0] == batch.num_seqs:  # one token a row (bursts run no drafts)
            self.last = (batch.positions.clone(), batch.context_lens.clone())
        return logits

    def forward_next(self, input_ids: np.ndarray, block_tables: np.ndarray) -> np.ndarray:
        assert isinstance(input_ids, np.ndarray) and isinstance(block_tables, np.ndarray)  # host arrays
        if self.last is None or len(self.last[0]) != len(input_ids):
            raise RuntimeError("forward_next continues a launch of one sequence a row, with the same rows")
        positions, context = self.last[0] + 1, self.last[1] + 1
        tables = torch.from_numpy(block_tables.copy())
        width = int((context.max() + self.page_size - 1) // self.page_size)
        rows = torch.arange(len(input_ids))
        kv_index = tables[rows, positions // self.page_size].long() * self.page_size + positions % self.page_size
        batch = ForwardBatch(
            input_ids=torch.from_numpy(np.asarray(input_ids, dtype=np.int64).copy()),
            positions=positions,
            query_start=torch.arange(len(input_ids) + 1, dtype=torch.int32),
            context_lens=context,
            block_tables=tables[:, :width],
            kv_index=kv_index,
            max_query_len=1,
            max_context_len=int(context.max()),
        )
        self.continued += 1
        logits = self.forward(batch)
        return logits.numpy()


def burst_pipeline(burst: int, pipelined: bool = True, eos_boost: float = 4.0, **kwargs) -> Pipeline:
    kwargs.setdefault("runner", FakeRunner(vocab_size=VOCAB, seed=1, boost={EOS: eos_boost}))
    kwargs.setdefault("max_batch", 16)
    return make_pipeline(pipelined, decode_burst=burst, **kwargs)


def some_requests(pipe: Pipeline, n: int, seed: int, temperature: float = 0.0, stop=(EOS,)) -> list:
    rng = random.Random(seed)
    return [
        add(pipe, [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))], rng.randint(1, 40), seed=i,
            temperature=temperature, stop=stop)
        for i in range(n)
    ]


def outputs(seqs) -> list:
    return [(s.handle.result(0).token_ids, s.handle.result(0).finish_reason) for s in seqs]


def recording_bursts(pipe: Pipeline) -> list[tuple[Burst, list[int], list[int]]]:
    """Each burst step's Burst, its rows' max_tokens and its logit rows' counters, taken at launch."""
    seen: list[tuple[Burst, list[int], list[int]]] = []
    launch = pipe.launch

    def recording():
        step = launch()
        if step is not None and step.burst is not None:
            counters = step.slot.np.counters[: step.num_logits].tolist()
            seen.append((step.burst, [seq.max_tokens for seq in step.rows], counters))
        return step

    pipe.launch = recording
    return seen


# ---- 1. the same tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("burst", [2, 3, 8])
def test_outputs_are_token_identical_to_decoding_one_token_a_step_in_fewer_steps(pipelined, temperature, burst):
    results = []
    for k in (1, burst):
        pipe = burst_pipeline(k, pipelined)
        seqs = some_requests(pipe, 6, seed=5, temperature=temperature)
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        results.append((outputs(seqs), pipe.stats.steps, pipe.stats.burst_steps))
    (plain, plain_steps, none), (bursting, steps, burst_steps) = results
    assert none == 0 and burst_steps > 0
    assert bursting == plain and steps < plain_steps
    assert any(reason is FinishReason.STOP for _, reason in plain)  # some ended inside a burst


def test_pipelined_and_blocking_give_the_same_tokens_with_bursts():
    results = []
    for pipelined in (True, False):
        pipe = burst_pipeline(4, pipelined)
        seqs = some_requests(pipe, 7, seed=11, temperature=0.5)
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        results.append(outputs(seqs))
    assert results[0] == results[1]


def test_every_burst_token_is_the_greedy_token_of_its_context():
    pipe = burst_pipeline(8, eos_boost=0.0)
    runner = pipe.runner
    seqs = some_requests(pipe, 3, seed=2, stop=())
    run_to_idle(pipe)
    assert pipe.stats.burst_steps > 0
    assert_greedy(runner, seqs)


# ---- 2. max_tokens and max_batch ------------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [2, 5, 9, 17])
def test_no_logit_row_samples_at_or_past_max_tokens(max_tokens):
    pipe = burst_pipeline(8, eos_boost=0.0)
    seen = recording_bursts(pipe)
    seq = add(pipe, [3, 4], max_tokens)
    run_to_idle(pipe)
    assert_idle_and_free(pipe)
    assert len(seq.handle.result(0).token_ids) == max_tokens
    assert seen or max_tokens == 2  # 2: the prefill and one decode step, no room for a burst
    for _, limits, counters in seen:
        assert max(counters) < limits[0]


def test_a_burst_step_fits_max_batch_logit_rows():
    pipe = burst_pipeline(8, max_batch=8, eos_boost=0.0)
    seen = recording_bursts(pipe)
    for i in range(3):
        add(pipe, [i + 1], 30)
    run_to_idle(pipe)
    assert seen
    for burst, limits, counters in seen:
        assert len(counters) <= 8 and burst.length == 8 // len(limits)


# ---- 3. stops -------------------------------------------------------------------------------------


def test_a_stop_id_inside_a_burst_ends_the_output_there():
    pipe = burst_pipeline(1, eos_boost=0.0)
    free = add(pipe, [7, 8], 30)
    run_to_idle(pipe)
    tokens = free.handle.result(0).token_ids
    stop = tokens[5]  # a token the greedy text reaches mid-burst (output index 5: the first burst's 4th)
    first = tokens.index(stop)
    pipe = burst_pipeline(8, eos_boost=0.0)
    seq = add(pipe, [7, 8], 30, stop=(stop,))
    run_to_idle(pipe)
    assert_idle_and_free(pipe)
    result = seq.handle.result(0)
    assert result.token_ids == tokens[:first] and result.finish_reason is FinishReason.STOP
    assert pipe.stats.tokens == first + 1  # the stop id is the last token committed: none of the burst's after it
    assert pipe.stats.burst_steps == 2  # the burst it ended, and the zombie step launched before that commit


@pytest.mark.parametrize("runner_class", [FakeRunner, ContinuingRunner])
def test_when_every_row_stops_the_burst_ends_and_its_zombie_step_runs_no_forward(runner_class):
    """Pipelined, the step after a burst is launched before the burst's commit; once every row of a
    burst has sampled a stop id, the burst runs no further forward, and the step after it, whose
    rows are all zombies, runs none at all (continued sub-steps too: runner.Continues)."""
    kwargs = dict(vocab_size=VOCAB, seed=1, boost={EOS: 4.0})
    plain = burst_pipeline(1, runner=FakeRunner(**kwargs))
    expected = add(plain, [11, 12], 50, stop=(EOS,))
    run_to_idle(plain)
    tokens = expected.handle.result(0).token_ids
    n = len(tokens)  # EOS is output index n
    assert expected.handle.result(0).finish_reason is FinishReason.STOP and n >= 3
    runner = runner_class(**kwargs)
    pipe = burst_pipeline(8, runner=runner)
    seq = add(pipe, [11, 12], 50, stop=(EOS,))
    run_to_idle(pipe)
    assert_idle_and_free(pipe)
    assert seq.handle.result(0).token_ids == tokens
    assert runner.forwards == n + 1  # the prefill and a forward per output token up to EOS; no zombie's
    assert pipe.stats.burst_steps >= 2  # the zombie step was a burst launched before the commit


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_stop_string_inside_a_burst_cuts_text_and_stream_where_decoding_does(h, tokenizer, pipelined):
    kw = {"vocab_size": VOCAB, "seed": 2}
    req = dict(prompt_ids=[40, 41, 42])
    with h.engine(pipelined, FakeRunner(**kw), tokenizer, decode_burst=1) as eng:
        free = eng.generate([Request(**req, sampling=SamplingParams(max_tokens=40, ignore_eos=True))])[0]
    stop = free.text[10:13]
    cut = free.text.index(stop)
    outs = []
    for burst in (1, 8):
        with h.engine(pipelined, FakeRunner(**kw), tokenizer, decode_burst=burst) as eng:
            handle = eng.submit(Request(**req, sampling=SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True)))
            deltas = list(handle)
            out = handle.result()
            bursts = eng.stats()["burst_steps"]
        assert out.text == free.text[:cut] and out.finish_reason is FinishReason.STOP
        assert "".join(deltas) == out.text
        outs.append((out.token_ids, bursts))
    assert outs[0][0] == outs[1][0] and outs[0][1] == 0 and outs[1][1] > 0


# ---- 4. pages, lanes, slots -----------------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [True, False])
def test_cancel_during_a_burst_frees_every_page_once(pipelined):
    pipe = burst_pipeline(8, pipelined, eos_boost=0.0)
    seqs = [add(pipe, [i + 2, i + 3], 60) for i in range(3)]
    while not pipe.stats.burst_steps:  # pipelined: a burst is in flight now; blocking: one has run
        pipe.tick()
    pipe.sequences.cancel(seqs[1].id)
    run_to_idle(pipe)
    assert_idle_and_free(pipe)
    assert seqs[1].handle.result(0).finish_reason is FinishReason.CANCELLED
    assert [len(s.handle.result(0).token_ids) for s in (seqs[0], seqs[2])] == [60, 60]


# ---- 5. when there is no burst --------------------------------------------------------------------


def test_no_burst_while_a_request_waits_and_the_newcomer_joins_the_next_launch():
    pipe = burst_pipeline(8, eos_boost=0.0)
    first = add(pipe, [5, 6], 40)
    while not pipe.inflight or pipe.inflight[-1].burst is None:
        pipe.tick()
    bursting = pipe.step_number - 1
    late = add(pipe, [9], 10)
    pipe.tick()  # the launch sees a request waiting: admitted now, no burst
    launched = pipe.inflight[-1]
    assert launched.number == bursting + 1 and launched.burst is None and late in launched.rows
    run_to_idle(pipe)
    assert_idle_and_free(pipe)
    plain = burst_pipeline(1, eos_boost=0.0)
    again = [add(plain, [5, 6], 40), add(plain, [9], 10)]
    run_to_idle(plain)
    assert outputs([first, late]) == outputs(again)


def test_rows_with_a_grammar_or_logprobs_never_burst(h):
    pipe = burst_pipeline(8, eos_boost=0.0)
    seen = recording_bursts(pipe)
    matcher = h.TrieMatcher([[5, 6, 7, 8, 9, 10, 11, 12]])
    constrained = add(pipe, [3], 20, matcher=matcher, stop=(EOS,))
    free = add(pipe, [4], 30)
    run_to_idle(pipe)
    assert_idle_and_free(pipe)
    assert constrained.handle.result(0).token_ids == [5, 6, 7, 8, 9, 10, 11, 12]
    assert len(free.handle.result(0).token_ids) == 30
    # bursts only once the constrained row is gone: each of them carries the free row alone
    assert seen and all(limits == [30] for _, limits, _ in seen)
    assert pipe.stats.burst_steps == len(seen)
    with h.engine(decode_burst=8) as eng:
        out = eng.generate([Request([4, 5], SamplingParams(max_tokens=20, logprobs=2, ignore_eos=True))])[0]
        assert len(out.logprobs) == 20 and eng.stats()["burst_steps"] == 0
        eng.generate([Request([4, 5], SamplingParams(max_tokens=20, ignore_eos=True))])
        assert eng.stats()["burst_steps"] > 0


def test_bursts_are_off_with_drafts_or_sliding_windows():
    runner = FakeRunner(vocab_size=VOCAB, seed=1, window=2)
    assert make_pipeline(True, runner=runner, decode_burst=8, speculative="ngram").decode_burst == 1
    sliding = FakeRunner(vocab_size=VOCAB, seed=1, window=8, sliding=True)
    assert make_pipeline(True, runner=sliding, decode_burst=8, sliding_pages=64).decode_burst == 1
    assert make_pipeline(True, decode_burst=8).decode_burst == 8


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "8"])
def test_a_burst_length_that_is_not_a_positive_int_is_refused(value):
    with pytest.raises(ValueError, match="decode_burst"):
        make_pipeline(True, decode_burst=value)


def test_the_engine_bursts_by_default_on_cpu_and_says_how_many_steps_burst(h):
    with h.engine() as eng:  # decode_burst None: the CPU default
        assert eng.config.decode_burst == 8
        out = eng.generate([Request([1, 2], SamplingParams(max_tokens=33, ignore_eos=True))])[0]
        stats = eng.stats()
    assert len(out.token_ids) == 33 and stats["burst_steps"] == 4  # 1 prefill, then 32 in bursts of 8
    assert stats["steps"] == 1 + 4 and stats["burst_ms"] > 0 and stats["forward_ms"] > 0  # the prefill's


def test_an_engine_with_bursts_equals_one_without_under_concurrent_seeded_requests(h):
    def requests():
        return [Request([i + 1, i + 2], SamplingParams(max_tokens=10 + 3 * i, temperature=0.7, seed=i)) for i in range(6)]

    outs = []
    for burst in (1, 8):
        runner = FakeRunner(vocab_size=VOCAB, seed=1, boost={EOS: 2.0})
        with Engine(runner, None, h.config(True, decode_burst=burst)) as eng:
            outs.append([(o.token_ids, o.finish_reason) for o in eng.generate(requests(), timeout=60)])
            assert eng.wait_idle(10) and eng.free_pages() == eng.config.num_pages
    assert outs[0] == outs[1]


# ---- runner.Continues ----------------------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("burst", [2, 8])
def test_a_runner_that_continues_its_launches_is_given_one_batch_a_burst_and_the_same_tokens(
    pipelined, temperature, burst
):
    """A host runner with `runner.Continues` gets a burst's first sub-step as a batch and the rest as
    continuations (host arrays: the last samples, the block tables); the tokens, greedy and
    seeded, stops inside bursts included, are those of decoding one token a step."""
    results = []
    for k, runner in ((1, FakeRunner), (burst, ContinuingRunner)):
        fake = runner(vocab_size=VOCAB, seed=1, boost={EOS: 4.0})
        pipe = burst_pipeline(k, pipelined, runner=fake)
        assert isinstance(fake, Continues) == (pipe.continues is fake)
        seqs = some_requests(pipe, 6, seed=5, temperature=temperature)
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        results.append((outputs(seqs), fake))
    (plain, _), (continued, fake) = results
    assert continued == plain and fake.continued > 0
    assert any(reason is FinishReason.STOP for _, reason in plain)


def test_continued_burst_tokens_are_the_greedy_tokens_of_their_contexts():
    runner = ContinuingRunner(vocab_size=VOCAB, seed=1, boost={EOS: 0.0})
    pipe = burst_pipeline(8, runner=runner)
    seqs = some_requests(pipe, 3, seed=2, stop=())
    run_to_idle(pipe)
    assert runner.continued > 0
    assert_greedy(runner, seqs)


def test_a_runner_off_the_host_is_never_continued():
    fake = ContinuingRunner(vocab_size=VOCAB, seed=1)
    fake.device = torch.device("meta")  # what the pipeline reads: where the runner's tensors live
    pipe = burst_pipeline(8, runner=fake)
    assert pipe.continues is None
