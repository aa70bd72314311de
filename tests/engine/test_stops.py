"""Invariant 2: nothing is emitted after a stop (EOS, stop token, stop string, max_tokens);
a zombie's extra token is dropped; no forward is scheduled past max_tokens."""

from __future__ import annotations

import pytest

from foveal.engine import FinishReason, Request, SamplingParams
from foveal.testing import FakeRunner


def _greedy_until_eos(ref: FakeRunner, prompt: list[int], eos: int, limit: int = 200) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(limit):
        t = int(ref.reference_logits(tokens).argmax())
        out.append(t)
        if t == eos:
            return out
        tokens.append(t)
    raise AssertionError("no EOS within the limit; pick another prompt")


@pytest.mark.parametrize("pipelined", [True, False])
def test_eos_stop_drops_the_zombie_token(h, pipelined):
    kw = {"vocab_size": h.VOCAB, "seed": 1, "boost": {h.EOS: 3.0}}
    prompt = [11, 12]
    expected = _greedy_until_eos(FakeRunner(**kw), prompt, h.EOS)
    k = len(expected) - 1  # EOS is output index k
    assert k >= 2
    runner = FakeRunner(**kw)
    with h.engine(pipelined, runner, decode_burst=1) as eng:  # one token a step (bursts: test_bursts.py)
        out = eng.generate([Request(prompt, SamplingParams(max_tokens=100))])[0]
        stats = eng.stats()
    assert out.token_ids == expected[:-1] and out.finish_reason is FinishReason.STOP
    # pipelined: step k+1 was launched before commit k saw EOS; it carried a zombie row
    assert runner.forwards == (k + 2 if pipelined else k + 1)
    assert stats["tokens"] == k + 1  # the zombie's token was never committed


@pytest.mark.parametrize("pipelined", [True, False])
def test_no_forward_past_max_tokens(h, pipelined):
    runner = FakeRunner(vocab_size=h.VOCAB, seed=1)
    with h.engine(pipelined, runner) as eng:
        out = eng.generate([Request([3], SamplingParams(max_tokens=5, ignore_eos=True))])[0]
    assert len(out.token_ids) == 5 and out.finish_reason is FinishReason.LENGTH
    assert runner.forwards == 5


def test_stop_token_ids(h):
    kw = {"vocab_size": h.VOCAB, "seed": 1}
    with h.engine(runner=FakeRunner(**kw)) as eng:
        free = eng.generate([Request([4, 5], SamplingParams(max_tokens=20, ignore_eos=True))])[0].token_ids
    stop = free[6]
    first = free.index(stop)
    with h.engine(runner=FakeRunner(**kw)) as eng:
        out = eng.generate(
            [Request([4, 5], SamplingParams(max_tokens=20, stop_token_ids=(stop,), ignore_eos=True))]
        )[0]
    assert out.token_ids == free[:first] and out.finish_reason is FinishReason.STOP


@pytest.mark.parametrize("pipelined", [True, False])
def test_stop_string_cuts_text_and_stream(h, tokenizer, pipelined):
    kw = {"vocab_size": h.VOCAB, "seed": 2}
    req = dict(prompt_ids=[40, 41, 42])
    with h.engine(pipelined, FakeRunner(**kw), tokenizer) as eng:
        free = eng.generate([Request(**req, sampling=SamplingParams(max_tokens=40, ignore_eos=True))])[0]
    stop = free.text[10:13]
    assert len(stop) == 3
    cut = free.text.index(stop)
    with h.engine(pipelined, FakeRunner(**kw), tokenizer) as eng:
        handle = eng.submit(
            Request(**req, sampling=SamplingParams(max_tokens=40, stop=(stop,), ignore_eos=True))
        )
        deltas = list(handle)
        out = handle.result()
    assert out.text == free.text[:cut] and out.finish_reason is FinishReason.STOP
    assert "".join(deltas) == out.text
    assert len(out.token_ids) < len(free.token_ids) and free.token_ids[: len(out.token_ids)] == out.token_ids


def test_output_never_exceeds_max_tokens(h):
    with h.engine() as eng:
        outs = eng.generate(
            [
                Request([i + 1], SamplingParams(max_tokens=1 + i % 7, temperature=1.0, seed=i))
                for i in range(40)
            ]
        )
    for i, out in enumerate(outs):
        assert len(out.token_ids) <= 1 + i % 7
        assert h.EOS not in out.token_ids
