"""Token logprobs (SamplingParams.logprobs, RequestOutput.logprobs, RequestHandle.logprobs()).

What they promise: one entry per output token, of the distribution the token was drawn from after
the grammar's mask (greedy rows at temperature 1; random rows tempered and filtered); forced tokens
0.0; alternatives best first and all allowed; and recording them never changes a sampled token.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from foveal.engine import Request, SamplingParams
from foveal.engine.request import MAX_LOGPROBS
from foveal.testing import FakeRunner


def _requests(n: int, seed: int, vocab: int, logprobs: int | None, **sampling) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(1, vocab) for _ in range(rng.randint(1, 10))],
            SamplingParams(max_tokens=rng.randint(1, 16), seed=rng.randrange(1 << 32), logprobs=logprobs, **sampling),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.9}, {"temperature": 1.2, "top_k": 7, "top_p": 0.8}], ids=["greedy", "T", "kp"]
)
def test_recording_logprobs_changes_no_token_and_pipelined_equals_blocking(h, sampling):
    runner_kw = {"boost": {h.EOS: 3.0}}
    plain, _ = h.run_both(lambda: _requests(24, 5, h.VOCAB, None, **sampling), runner_kw)
    piped, blocking = h.run_both(lambda: _requests(24, 5, h.VOCAB, 5, **sampling), runner_kw)
    assert [o.token_ids for o in piped] == [o.token_ids for o in plain]
    assert [o.token_ids for o in blocking] == [o.token_ids for o in plain]
    assert [o.logprobs for o in piped] == [o.logprobs for o in blocking]
    assert all(o.logprobs is None for o in plain)
    for out in piped:
        assert [lp.token_id for lp in out.logprobs] == out.token_ids  # aligned; the EOS is not in either
        for lp in out.logprobs:
            assert lp.logprob <= 0.0
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True) and len(lp.top) <= 5
            assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5


def test_greedy_logprobs_are_the_models_log_softmax(h):
    """Greedy rows: log_softmax of the model's logits at temperature 1; the sampled token is the top one."""
    reqs = _requests(8, 9, h.VOCAB, MAX_LOGPROBS)
    outs, _ = h.run_both(lambda: _requests(8, 9, h.VOCAB, MAX_LOGPROBS), {"boost": {h.EOS: 1.0}})
    ref = FakeRunner(vocab_size=h.VOCAB, seed=1, boost={h.EOS: 1.0})
    for req, out in zip(reqs, outs, strict=True):
        context = list(req.prompt_ids)
        for lp in out.logprobs:
            expected = torch.log_softmax(ref.reference_logits(context).float(), dim=-1)
            top = expected.topk(MAX_LOGPROBS)
            assert lp.logprob == pytest.approx(float(expected[lp.token_id]), abs=1e-5)
            assert lp.top[0][0] == lp.token_id
            assert [i for i, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)
            context.append(lp.token_id)


@pytest.mark.parametrize("pipelined", [True, False])
def test_under_a_mask_alternatives_are_allowed_tokens_and_a_lone_choice_is_certain(h, pipelined):
    options = [[10, 11, 12], [10, 11, 13], [14]]
    runner = FakeRunner(vocab_size=h.VOCAB, seed=2)
    with h.engine(pipelined, runner) as eng:
        out = eng.generate(
            [Request([1, 2, 3], SamplingParams(max_tokens=8, logprobs=4), matcher=h.TrieMatcher(options))],
            timeout=30,
        )[0]
    assert out.token_ids in options
    allowed = [{10, 14}, {11}, {12, 13}]
    for position, lp in enumerate(out.logprobs):
        ids = {i for i, _ in lp.top}
        assert ids <= allowed[position] if out.token_ids[0] == 10 else ids <= {10, 14}
        assert math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0, abs_tol=1e-5)  # all allowed ones listed
        if len(allowed[position]) == 1 and out.token_ids[0] == 10:
            assert lp.logprob == 0.0


def test_forced_tokens_of_jump_forward_are_certain_and_equal_the_plain_run(h, tokenizer):
    from foveal import grammars

    automaton = grammars.compile(grammars.Regex(r'\{"label": "(cat|dog)"\}'), tokenizer, eos_token_id=h.EOS,
                                 vocab_size=h.VOCAB)
    outs = {}
    for jump in (False, True):
        with h.engine(True, FakeRunner(vocab_size=h.VOCAB, seed=3), tokenizer, jump_forward=jump) as eng:
            outs[jump] = eng.generate(
                [Request([5, 6], SamplingParams(max_tokens=40, logprobs=2), matcher=automaton.matcher())],
                timeout=30,
            )[0]
    assert outs[True].token_ids == outs[False].token_ids
    assert [lp.token_id for lp in outs[True].logprobs] == outs[True].token_ids
    # with one token allowed, the logprob is 0 whether the token was sampled under a one-token mask
    # or forced without a forward
    assert [lp.logprob == 0.0 for lp in outs[True].logprobs] == [lp.logprob == 0.0 for lp in outs[False].logprobs]
    assert sum(lp.logprob == 0.0 for lp in outs[True].logprobs) >= 8  # the braces, quotes and key are forced


def test_the_handle_shows_the_logprobs_committed_so_far(h, tokenizer):
    with h.engine(True, FakeRunner(vocab_size=h.VOCAB, seed=1), tokenizer) as eng:
        handle = eng.submit(Request([3, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)))
        seen = []
        for _ in handle:
            seen.append(len(handle.logprobs()))
        out = handle.result(30)
    assert seen == sorted(seen) and len(handle.logprobs()) == len(out.token_ids) == 12
    assert handle.logprobs() == out.logprobs
    with h.engine(True, FakeRunner(vocab_size=h.VOCAB, seed=1), tokenizer) as eng:
        quiet = eng.submit(Request([3, 4, 5], SamplingParams(max_tokens=3)))
        assert quiet.result(30).logprobs is None and quiet.logprobs() == []


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.5])
def test_out_of_range_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)
