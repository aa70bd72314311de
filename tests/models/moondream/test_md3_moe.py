"""Moondream 3's mixture of experts (moe.py): every strategy the runner uses equals the per-expert loop,
routing is top-k by logit with a float32 softmax over the k, and a decode launch's strategy traces."""

from __future__ import annotations

import pytest
import torch

from foveal.families.moondream.config import MoeConfig
from foveal.families.moondream.moe import MoE

CFG = MoeConfig(num_experts=8, start_layer=0, experts_per_token=2, expert_inner_dim=16)


@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    module = MoE(32, CFG)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module.eval().requires_grad_(False)


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 40])
@pytest.mark.parametrize("strategy", ["gathered", "dense", "grouped", "grouped_mm"])
def test_strategies_equal_the_loop(moe, rows, strategy):
    h = torch.randn(rows, 32)
    experts, weights = moe.route(h)
    got = getattr(moe, strategy)(h, experts, weights)
    torch.testing.assert_close(got, moe.looped(h, experts, weights), atol=1e-5, rtol=1e-5)


def test_routing(moe):
    h = torch.randn(5, 32)
    experts, weights = moe.route(h)
    logits = moe.router(h)
    assert torch.equal(experts, logits.topk(2, dim=-1).indices)
    torch.testing.assert_close(weights, logits.gather(1, experts).softmax(-1))
    assert torch.allclose(weights.sum(-1), torch.ones(5))


def test_forward_picks_by_shape(moe, monkeypatch):
    """torch's grouped matmul where it runs (every CPU launch); else prefill groups and decode gathers
    while rows * k <= experts, else runs every expert densely."""
    from foveal.families.moondream import moe as module

    calls: list[str] = []
    for name in ("grouped_mm", "grouped", "gathered", "dense"):
        method = getattr(module.MoE, name)
        monkeypatch.setattr(module.MoE, name, lambda self, *a, _m=method, _n=name: calls.append(_n) or _m(self, *a))
    for runs in (True, False):
        monkeypatch.setattr(module, "grouped_mm_runs", lambda h, _r=runs: _r)
        for rows, decode in ((2, True), (7, True), (7, False)):
            h = torch.randn(rows, 32)
            torch.testing.assert_close(moe(h, decode), moe.looped(h, *moe.route(h)), atol=1e-5, rtol=1e-5)
    assert calls == ["grouped_mm"] * 3 + ["gathered", "dense", "grouped"]


def test_grouped_mm_runs_on_cpu_and_not_on_cuda_in_float32():
    from foveal.families.moondream.moe import grouped_mm_runs

    assert grouped_mm_runs(torch.zeros(1, 4)) and grouped_mm_runs(torch.zeros(1, 4, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        assert not grouped_mm_runs(torch.zeros(1, 4, device="cuda"))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # the rows are fixed by the trace: intended
@pytest.mark.filterwarnings("ignore:.*torch.jit.trace. is deprecated:DeprecationWarning")
@pytest.mark.parametrize("rows", [2, 8])
def test_decode_strategies_trace(moe, rows):
    """A traced decode step replays any routing (no shape depends on it)."""
    traced = torch.jit.trace(lambda h: moe(h, True), torch.randn(rows, 32), check_trace=False)
    for _ in range(3):
        h = torch.randn(rows, 32)
        torch.testing.assert_close(traced(h), moe.looped(h, *moe.route(h)), atol=1e-5, rtol=1e-5)
