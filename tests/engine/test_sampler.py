"""The sampler: mask honoured, greedy, top-k / top-p, and seeded noise that is a per-row function."""

from __future__ import annotations

import math

import pytest
import torch

from foveal.engine.sampler import (
    UNIFORM_BITS,
    SamplingBatch,
    apply_bitmask,
    filter_top_k_top_p,
    gumbel_noise,
    sample,
    uniform_from_bits,
)


def _batch(
    n: int, temperature=0.0, top_k=0, top_p=1.0, seeds=None, counters=None, bitmask=None, mask_rows=None
):
    t = torch.full((n,), float(temperature))
    random_rows = torch.nonzero(t > 0).flatten() if temperature > 0 else None
    return SamplingBatch(
        temperature=t,
        top_p=torch.full((n,), float(top_p)),
        top_k=torch.full((n,), top_k, dtype=torch.int64),
        seeds=torch.tensor(seeds if seeds is not None else list(range(n)), dtype=torch.int64),
        counters=torch.tensor(counters if counters is not None else [0] * n, dtype=torch.int64),
        random_rows=random_rows,
        filter_rows=top_k > 0 or top_p < 1,
        bitmask=bitmask,
        mask_rows=mask_rows,
    )


def test_bitmask_applies_to_its_rows_only():
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 2] = 1 << 3  # only token 67
    apply_bitmask(logits, bitmask, torch.tensor([1]))
    assert torch.isinf(logits[1]).sum() == 69 and logits[1, 67] == 0
    assert not torch.isinf(logits[0]).any() and not torch.isinf(logits[2]).any()


def test_bitmask_sign_bit_token():
    logits = torch.zeros(1, 64)
    bitmask = torch.tensor([[0, -(1 << 31)]], dtype=torch.int32)  # bit 31 of word 1: token 63
    apply_bitmask(logits, bitmask, torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [63]


def test_greedy_is_argmax_and_respects_the_mask():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    out = torch.empty(4, dtype=torch.int64)
    sample(logits.clone(), _batch(4), out)
    assert out.tolist() == logits.argmax(-1).tolist()
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[:, 1] = 1 << 5  # token 37
    sample(logits.clone(), _batch(4, bitmask=bitmask, mask_rows=torch.tensor([0, 3])), out)
    assert out[0] == 37 and out[3] == 37 and out[1] == logits[1].argmax()


def test_noise_is_a_function_of_seed_and_counter_only():
    a = gumbel_noise(torch.tensor([5, 6]), torch.tensor([3, 3]), 100)
    b = gumbel_noise(torch.tensor([9, 5]), torch.tensor([1, 3]), 100)
    assert torch.equal(a[0], b[1])
    assert not torch.equal(a[0], a[1])
    assert torch.isfinite(a).all()


def test_sampling_frequencies_follow_the_softmax():
    """10,000 draws (distinct counters) from one row: frequencies within 4 sigma of softmax(l / T)."""
    n, temperature = 10_000, 0.7
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    logits = base.repeat(n, 1)
    out = torch.empty(n, dtype=torch.int64)
    sample(logits, _batch(n, temperature, seeds=[42] * n, counters=list(range(n))), out)
    freq = torch.bincount(out, minlength=6).double() / n
    probs = (base / temperature).softmax(-1).double()
    for f, p in zip(freq.tolist(), probs.tolist(), strict=True):
        assert abs(f - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_top_k_and_top_p_keep_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def kept(k: int, p: float) -> list[bool]:
        return torch.isfinite(filter_top_k_top_p(logits, torch.tensor([k]), torch.tensor([p])))[0].tolist()

    assert kept(2, 1.0) == [True, True, False, False]
    assert kept(0, 0.7) == [True, True, False, False]  # 0.5 < 0.7, 0.8 >= 0.7: the second token closes it
    assert kept(0, 0.1) == [True, False, False, False]  # the best token always stays
    assert kept(1, 1.0) == [True, False, False, False]
    n = 2000
    out = torch.empty(n, dtype=torch.int64)
    sample(logits.repeat(n, 1), _batch(n, 1.0, top_k=2, seeds=[1] * n, counters=list(range(n))), out)
    assert set(out.tolist()) == {0, 1}


def test_uniform_noise_stays_strictly_inside_the_unit_interval():
    # the extreme draws once rounded to 1.0, making the Gumbel noise +inf and a masked token win
    bits = torch.tensor([0, 1, (1 << UNIFORM_BITS) - 2, (1 << UNIFORM_BITS) - 1])
    u = uniform_from_bits(bits)
    assert bool(((u > 0) & (u < 1)).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


@pytest.mark.slow  # 66M draws: about 10 s; the test above covers the cause in the default run
def test_masked_tokens_never_win_over_many_seeded_draws():
    vocab = 257_000  # PaliGemma-sized: the rounding bug hit about V / 2**24 of draws
    n = 64
    logits = torch.zeros(n, vocab)
    bitmask = torch.zeros(n, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[:, 0] = 0b1010  # only tokens 1 and 3 allowed
    batch = SamplingBatch(
        temperature=torch.ones(n),
        top_p=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        seeds=torch.arange(n, dtype=torch.int64),
        counters=torch.zeros(n, dtype=torch.int64),
        random_rows=torch.arange(n),
        filter_rows=False,
        bitmask=bitmask,
        mask_rows=torch.arange(n),
    )
    for step in range(4):
        batch.counters.fill_(step)
        out = torch.empty(n, dtype=torch.int64)
        sample(logits.clone(), batch, out)
        assert set(out.tolist()) <= {1, 3}


def test_bitmask_penalties_equal_an_independent_bit_unpacking():
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's high bits name no token
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, vocab, generator=gen)
    rows = torch.tensor([4, 0, 2])
    got = logits.clone()
    apply_bitmask(got, bitmask, rows)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    expected = logits.clone()
    for i, row in enumerate(rows.tolist()):
        expected[row][torch.from_numpy(bits[i] == 0)] = float("-inf")
    assert torch.equal(got, expected)


def test_seeds_use_all_64_bits():
    """Seeds s and s + 2**32 (and s + 2**63) draw different noise; seeds below 2**32 keep their old key."""
    from foveal.engine.request import seed_as_int64
    from foveal.engine.sampler import _mix32, seed_key

    base = 123456
    seeds = torch.tensor([seed_as_int64(s) for s in (base, base + 2**32, base + 2**63, 2**64 - 1)])
    noise = gumbel_noise(seeds, torch.zeros(4, dtype=torch.int64), 1000)
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(noise[a], noise[b]), (a, b)
    low = torch.tensor([0, 1, base, 2**32 - 1])
    assert torch.equal(seed_key(low), _mix32(low))


@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 0.0], ids=["1e-46", "1e-300", "0"])
def test_a_top_p_that_float32_holds_as_zero_keeps_the_best_token(top_p):
    """top_p below float32's smallest value is 0 on the device: the nucleus still holds the best token."""
    logits = torch.tensor([[0.1, 2.0, 0.5, -1.0]])
    kept = torch.isfinite(
        filter_top_k_top_p(logits, torch.tensor([0]), torch.tensor([top_p], dtype=torch.float32))
    )
    assert kept[0].tolist() == [False, True, False, False]


@pytest.mark.parametrize("temperature", [0.7, 1e-40], ids=["0.7", "subnormal 1e-40"])
def test_underflowing_settings_never_sample_a_disallowed_token(temperature):
    # Token 0 is masked out; before, a nucleus of nothing (top_p 1e-46 held as 0) sampled it anyway.
    n, vocab = 16, 40
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 10
    bitmask = torch.full((n, 2), -1, dtype=torch.int32)
    bitmask[:, 0] = -2  # bit 0 clear: token 0 disallowed
    batch = _batch(
        n, temperature, top_p=1e-46, counters=list(range(n)), bitmask=bitmask, mask_rows=torch.arange(n)
    )
    batch.top_p = torch.full((n,), 1e-46, dtype=torch.float32)
    out = torch.empty(n, dtype=torch.int64)
    sample(logits, batch, out)
    masked = logits.clone()
    masked[:, 0] = float("-inf")
    assert out.tolist() == masked.argmax(dim=-1).tolist()  # a nucleus of one: the best allowed token


def test_argmax_rows_is_torchs_argmax_ties_infinities_and_nans_included():
    from foveal.engine.sampler import argmax_rows

    values = torch.randn(6, 1000)
    values[1, [3, 700]] = 50.0  # a tie: the first
    values[2] = float("-inf")  # nothing allowed: 0, as torch gives
    values[3, 5] = float("inf")
    values[4, [9, 20]] = float("nan")  # the first NaN counts as the largest, in both
    values[5, -1] = 1e30
    assert torch.equal(argmax_rows(values), values.argmax(dim=-1))
    assert argmax_rows(values).dtype == torch.int64
    assert torch.equal(argmax_rows(values[:, ::2]), values[:, ::2].argmax(dim=-1))  # a strided view
