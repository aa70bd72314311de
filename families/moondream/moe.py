"""Moondream 3's mixture of experts: routing, and the experts computed per batch without a loop per expert.

PROBLEM
    From `moe.start_layer` on, each token's MLP is a weighted sum of `experts_per_token` (k) of
    `num_experts` (E) GeGLU experts: router logits = h W_r^T + b_r, the k experts of highest logit,
    weights = softmax of those k logits (float32); expert e computes u = h W1_e^T, a = u[:inner],
    g = u[inner:], y_e = (gelu_exact(a) * (g + 1)) W2_e^T (no biases). A Python loop over experts
    launches E small matmuls per layer and, on CPU, retakes the GIL between them; a traced decode
    graph cannot hold a loop whose trip count depends on the routing.
SOLUTION
    `grouped_mm`, where torch's grouped matmul runs (every CPU dtype; CUDA in bfloat16 from compute
    capability 9.0): the (token, expert) pairs sorted by expert, the offsets of each expert's run
    counted on the device, and `torch._grouped_mm` over the whole stacks, twice, reading only the
    experts used and copying no weight; T * k rows whatever the routing, so a traced decode graph
    replays it, and no host read. The fastest or tied at every batch size measured (docs/performance.md).
    Elsewhere, three ways to compute the same sum, chosen by the launch's shape (never by the routing, so a
    traced decode graph replays whatever the routing):
    `gathered`  few rows (T * k <= E, a small decode batch): each (token, expert) pair gathers its
                expert's weights (index_select) and one bmm computes all pairs; reads only the
                experts used.
    `dense`     a decode batch with more pairs than experts: every expert over every row in two
                batched matmuls, combined by the [T, E] routing weights (zero where not routed);
                static shapes, each expert's weights read once.
    `grouped`   prefill (eager, many rows): the pairs sorted by expert and packed into an
                [E, capacity, dim] block (capacity = the busiest expert's count, one host read),
                two bmm, then each pair's output added back to its token (index_add).
    `looped` is the per-expert loop, kept as the oracle of tests and benchmarks.
    Under int8 / int4 the stacks are `moe_quant.QuantStack`s: decode runs moe_quant's gathered and
    dense on torch's int kernels; grouped, looped and adapters read their dequantized `weight`.
INVARIANTS
    - All strategies give the same output up to float summation order (tests/models/moondream/test_md3_moe.py).
    - The expert stacks are the checkpoint's: fc1 [E, 2 * inner, dim], fc2 [E, dim, inner].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import moe_quant
from .config import MoeConfig
from .moe_quant import QuantStack


def grouped_mm_runs(h: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` computes this launch: on CPU in any dtype; on CUDA in bfloat16 on
    compute capability 9.0 or later (its kernel's requirement)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if h.device.type == "cpu":
        return True
    return h.device.type == "cuda" and h.dtype == torch.bfloat16 and torch.cuda.get_device_capability(h.device) >= (9, 0)


class ExpertStack(nn.Module):
    """One weight tensor [experts, out, in] under the checkpoint's name `<module>.weight`."""

    def __init__(self, experts: int, out: int, inp: int, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out, inp, **factory))


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoeConfig, **factory) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(dim, cfg.num_experts, **factory)
        self.fc1: ExpertStack | QuantStack = ExpertStack(cfg.num_experts, 2 * cfg.expert_inner_dim, dim, **factory)
        self.fc2: ExpertStack | QuantStack = ExpertStack(cfg.num_experts, dim, cfg.expert_inner_dim, **factory)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, k] expert ids, [T, k] weights in h's dtype): top-k by logit, softmax over the k in float32."""
        top, experts = self.router(h).topk(self.cfg.experts_per_token, dim=-1)
        return experts, top.float().softmax(dim=-1).to(h.dtype)

    def forward(self, h: torch.Tensor, decode: bool) -> torch.Tensor:
        """h [T, dim] -> [T, dim]. `decode`: a decode launch (possibly traced: static strategies only)."""
        experts, weights = self.route(h)
        quantized = isinstance(self.fc1, QuantStack) and isinstance(self.fc2, QuantStack)  # moe_quant.py
        if not quantized and grouped_mm_runs(h):
            return self.grouped_mm(h, experts, weights)
        if not decode:
            return self.grouped(h, experts, weights)
        few = h.shape[0] * self.cfg.experts_per_token <= self.cfg.num_experts
        if isinstance(self.fc1, QuantStack) and isinstance(self.fc2, QuantStack):
            strategy = moe_quant.gathered if few else moe_quant.dense
            return strategy(self.fc1, self.fc2, self._geglu, h, experts, weights)
        return self.gathered(h, experts, weights) if few else self.dense(h, experts, weights)

    def grouped_mm(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = self.cfg.experts_per_token
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # the pairs by expert; order // k is each pair's token
        ends = torch.bincount(flat, minlength=self.cfg.num_experts).cumsum(0).to(torch.int32)
        token = order // k
        u = torch._grouped_mm(h.index_select(0, token), self.fc1.weight.transpose(1, 2), offs=ends)
        y = torch._grouped_mm(self._geglu(u), self.fc2.weight.transpose(1, 2), offs=ends)  # [T * k, dim]
        y = y * weights.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(h).index_add_(0, token, y)

    def _geglu(self, u: torch.Tensor) -> torch.Tensor:
        a, g = u.split(self.cfg.expert_inner_dim, dim=-1)
        return F.gelu(a) * (g + 1)

    def gathered(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = self.cfg.experts_per_token
        flat = experts.reshape(-1)
        rows = h.repeat_interleave(k, dim=0)[:, :, None]  # [T * k, dim, 1]
        u = torch.bmm(self.fc1.weight.index_select(0, flat), rows)[..., 0]
        y = torch.bmm(self.fc2.weight.index_select(0, flat), self._geglu(u)[:, :, None])[..., 0]
        return (y.view(h.shape[0], k, -1) * weights[..., None]).sum(dim=1)

    def dense(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        u = torch.matmul(h[None], self.fc1.weight.transpose(1, 2))  # [E, T, 2 * inner]
        y = torch.matmul(self._geglu(u), self.fc2.weight.transpose(1, 2))  # [E, T, dim]
        routing = torch.zeros(h.shape[0], self.cfg.num_experts, dtype=h.dtype, device=h.device)
        routing = routing.scatter(1, experts, weights)  # [T, E], zero where not routed
        return torch.einsum("te,etd->td", routing, y)

    def grouped(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k, num = self.cfg.experts_per_token, self.cfg.num_experts
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        expert = flat.index_select(0, order)
        token = order // k
        counts = torch.bincount(flat, minlength=num)
        capacity = int(counts.max())  # the one host read: the block's width
        slot = torch.arange(flat.shape[0], device=h.device) - (counts.cumsum(0) - counts).index_select(0, expert)
        block = h.new_zeros(num, capacity, h.shape[1])
        block[expert, slot] = h.index_select(0, token)
        u = torch.bmm(block, self.fc1.weight.transpose(1, 2))
        y = torch.bmm(self._geglu(u), self.fc2.weight.transpose(1, 2))[expert, slot]  # [T * k, dim]
        y = y * weights.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(h).index_add_(0, token, y)

    def looped(self, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The per-expert loop (the oracle; not used by the runner)."""
        out = torch.zeros_like(h)
        w1, w2 = self.fc1.weight, self.fc2.weight  # read once: a quantized stack dequantizes on each read
        for e in range(self.cfg.num_experts):
            token, slot = (experts == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            u = h.index_select(0, token) @ w1[e].T
            y = self._geglu(u) @ w2[e].T
            out.index_add_(0, token, y * weights[token, slot][:, None])
        return out
