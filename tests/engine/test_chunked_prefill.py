"""Chunked prefill (scheduler.py): a long text prompt is prefilled a chunk per step while the other
rows keep decoding, a chunk that does not end the prompt yields no token, and outputs equal an
unchunked run (the fake runner reads every position back from the pages) in both modes."""

from __future__ import annotations

import random

import pytest

from foveal.engine.request import FinishReason
from foveal.testing import FakeRunner
from tests.engine.test_pipeline_steps import EOS, VOCAB, add, assert_idle_and_free, make_pipeline, run_to_idle


def chunked(pipelined: bool = True, chunk: int = 8, **sizes):
    return make_pipeline(pipelined, runner=FakeRunner(vocab_size=VOCAB, seed=5), prefill_chunk=chunk, **sizes)


def test_a_long_prompt_is_prefilled_a_chunk_a_step_beside_a_decoding_row():
    pipe = chunked(max_model_len=128)
    decoding = add(pipe, [3, 4], max_tokens=12)
    pipe.tick()
    long_prompt = add(pipe, list(range(1, 31)), max_tokens=3)  # 30 tokens: chunks of 8, 8, 8, 6
    steps = []
    launch = pipe.launch

    def recording_launch():
        step = launch()
        if step is not None:
            steps.append((step.rows.copy(), step.num_tokens, set(step.partial)))
        return step

    pipe.launch = recording_launch
    run_to_idle(pipe)
    carrying = [(rows, tokens, partial) for rows, tokens, partial in steps if long_prompt in rows]
    assert [tokens for _, tokens, _ in carrying[:4]] == [9, 9, 9, 7]  # the decoding row's token + a chunk
    assert all(decoding in rows for rows, _, _ in carrying[:4])  # it never waits for the prompt
    assert [len(partial) for _, _, partial in carrying[:4]] == [1, 1, 1, 0]
    assert long_prompt.handle.result(0).finish_reason is FinishReason.LENGTH
    assert len(long_prompt.token_ids) == 3 and len(decoding.token_ids) == 12
    assert_idle_and_free(pipe)


@pytest.mark.parametrize("pipelined", [True, False])
def test_chunked_and_whole_prefill_give_the_same_tokens(pipelined):
    outputs = []
    for chunk in (5, 1000):
        pipe = chunked(pipelined, chunk, max_model_len=128, max_step_tokens=64)
        rng = random.Random(2)
        seqs = [
            add(pipe, [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))], rng.randint(1, 10),
                stop=(EOS,), seed=rng.randrange(2**64), temperature=rng.choice([0.0, 1.0]))
            for _ in range(10)
        ]
        run_to_idle(pipe)
        assert_idle_and_free(pipe)
        outputs.append([(s.handle.result(0).token_ids, s.finish_reason) for s in seqs])
    assert outputs[0] == outputs[1]


def test_no_step_carries_more_than_max_step_tokens():
    pipe = chunked(chunk=64, max_step_tokens=16, max_model_len=128)
    for i in range(4):
        add(pipe, [i + 1] * 37, max_tokens=4)
    launch = pipe.launch
    sizes = []
    pipe.launch = lambda: (step := launch()) and sizes.append(step.num_tokens) or step
    run_to_idle(pipe)
    assert sizes and max(sizes) <= 16
    assert_idle_and_free(pipe)


@pytest.mark.parametrize("pipelined", [True, False])
def test_cancel_during_a_chunked_prefill_frees_everything(pipelined):
    pipe = chunked(pipelined, max_model_len=128)
    seq = add(pipe, list(range(1, 41)), max_tokens=5)
    other = add(pipe, [7], max_tokens=6)
    pipe.tick()
    pipe.tick()
    assert 0 < seq.num_prefilled < seq.prompt_len
    pipe.sequences.cancel(seq.id)
    run_to_idle(pipe)
    assert seq.finish_reason is FinishReason.CANCELLED and seq.token_ids == []
    assert other.finish_reason is FinishReason.LENGTH
    assert_idle_and_free(pipe)
