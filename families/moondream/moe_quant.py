"""Moondream 3's expert stacks as int8 / int4 weights, and the MoE's decode strategies on torch's int kernels.

PROBLEM
    The experts are most of Moondream 3's weights (86.9 % of the 9B checkpoint), so int8 / int4 pay
    only if they are quantized. torch's weight-only CPU kernels (`_weight_int8pack_mm`,
    `_weight_int4pack_mm_for_cpu`) multiply one 2-D weight: there is no batched form, so an
    [E, out, in] stack cannot be bmm's operand, and one call per expert (or per routed pair) is the
    Python loop moe.py avoids (and a traced decode graph cannot hold a routing-dependent loop).
SOLUTION
    Each stack is one 2-D quantized weight (a `QuantLinear`), its experts laid end to end along the
    dimension the MoE needs to select or sum over:
      fc1 (`ROWS`): [E * 2 inner, dim], expert e's output rows from e * 2 inner. Every expert's rows are
          whole blocks of torch's int4 layout (checked, int4_layout.joins), so the packed rows of any
          experts, gathered, are the packing of their rows joined.
      fc2 (`COLUMNS`): [dim, E * inner], expert e's input columns from e * inner: the routing-weighted
          sum over a token's experts is one matmul over their inputs laid side by side, each scaled by
          its routing weight. int4 groups (32 inputs) never straddle two experts (inner is a multiple
          of the group size); int8's scale is per output row (the kernel's only form), so a row's
          scale is shared by every expert's part of that row.
    The decode strategies (moe.MoE picks them by shape, as for float stacks):
      `gathered` (T * k <= E): the P = T * k routed experts' codes and scales are gathered into one
          weight (index_select on the packed bytes: fc1's rows; fc2's columns, per block of torch's
          layout, whose bytes are column-major inside a block, so the gather holds on AVX2's 32-row
          and AVX-512's 64-row blocks alike), then one kernel call per stack. With T > 1 rows, each
          row is multiplied by every row's experts and keeps its own (T times the pairs' arithmetic;
          each gathered weight byte is still read once, and T <= E / k).
      `dense` (more pairs): every expert over every row: fc1 one call, fc2 one call over the GeGLU
          outputs scaled by the [T, E] routing weights (zero where not routed).
    `grouped` (prefill) and adapters (lora.py) read `weight`: the stack dequantized to [E, out, in]
    in the compute dtype, once per launch, as a `QuantLinear` dequantizes for many rows.
INVARIANTS
    - `weight` is the stack the kernels multiply by (up to their float rounding): the strategies agree
      with `moe.MoE.looped` over it (tests/models/moondream/test_md_quant.py).
    - Shapes depend on the launch's rows and k only, never on the routing: traced graphs replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from foveal.engine.models import int4_layout
from foveal.engine.models.quant import GROUP_SIZE, QuantLinear, check_int4_shape

ROWS, COLUMNS = "rows", "columns"


class QuantStack(nn.Module):
    """An expert stack [E, out, in] held as one int8 / int4 `QuantLinear` (layout ROWS or COLUMNS)."""

    def __init__(self, linear: QuantLinear, experts: int, out: int, inp: int, layout: str) -> None:
        super().__init__()
        self.linear = linear
        self.mode = linear.mode
        self.experts, self.out, self.inp, self.layout = experts, out, inp, layout
        # fc2's int4 bytes are gathered per segment of torch's layout for `out` rows (static per CPU)
        found = int4_layout.layout(out) if self.mode == "int4" and layout == COLUMNS else None
        self.segments = () if found is None else found.segments

    @classmethod
    def check(cls, experts: int, out: int, inp: int, mode: str, layout: str) -> None:
        """Raise ValueError where `mode` cannot hold a stack of this shape in `layout`."""
        if mode != "int4":
            return
        if layout == ROWS:
            check_int4_shape(experts * out, inp, GROUP_SIZE)
            if not all(int4_layout.joins([out] * p) for p in range(1, experts + 1)):
                raise ValueError(
                    f"int4 experts need each expert's {out} rows to be whole blocks of torch's int4 layout "
                    "(a multiple of 64 rows); use quantize='int8' for this model"
                )
            return
        check_int4_shape(out, experts * inp, GROUP_SIZE)
        if inp % GROUP_SIZE or int4_layout.layout(out) is None:
            raise ValueError(
                f"int4 experts need an inner dim divisible by {GROUP_SIZE} and an output dim of a known int4 "
                f"layout; got {inp} and {out}. Use quantize='int8' for this model"
            )

    @classmethod
    def from_stack(cls, weight: torch.Tensor, mode: str, layout: str, dtype: torch.dtype) -> QuantStack:
        experts, out, inp = weight.shape
        cls.check(experts, out, inp, mode, layout)
        w = weight.detach()
        flat = w.reshape(experts * out, inp) if layout == ROWS else w.permute(1, 0, 2).reshape(out, experts * inp)
        make = QuantLinear.int8_from_float if mode == "int8" else QuantLinear.int4_from_float
        return cls(make(flat, None, dtype), experts, out, inp, layout)

    @property
    def weight(self) -> torch.Tensor:
        """The stack [E, out, in] the kernels multiply by, in the compute dtype (a new tensor each read)."""
        w = self.linear.dequantize()
        stack = w.view(self.experts, self.out, self.inp) if self.layout == ROWS else (
            w.view(self.out, self.experts, self.inp).permute(1, 0, 2)
        )
        return stack.to(self.linear.weight_dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert at once: ROWS [T, in] -> [T, E * out]; COLUMNS [T, E * in] -> [T, out]."""
        return self.linear(x)

    def gathered(self, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """x times the P experts `flat` [P] as one weight: ROWS [T, in] -> [T, P * out] (expert-major),
        COLUMNS [T, P * in] (the experts' inputs side by side) -> [T, out]."""
        packed, scales = self._select(flat)
        q = self.linear
        if self.mode == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, packed, scales)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, q.group_size, scales)

    def _select(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scales) of the experts `flat`, laid out as one QuantLinear's."""
        q, e, out, inp, p = self.linear, self.experts, self.out, self.inp, flat.shape[0]
        if self.layout == ROWS:
            row_bytes = q.packed.shape[1]
            packed = q.packed.view(e, out * row_bytes).index_select(0, flat).view(p * out, row_bytes)
            if self.mode == "int8":  # scales [E * out]
                return packed, q.scales.view(e, out).index_select(0, flat).reshape(p * out)
            groups = q.scales.shape[0]  # [in / group, E * out, 2]
            return packed, q.scales.view(groups, e, out, 2).index_select(1, flat).reshape(groups, p * out, 2)
        if self.mode == "int8":  # codes [out, E * in], one scale per output row (shared by the experts)
            return q.packed.view(out, e, inp).index_select(1, flat).reshape(out, p * inp), q.scales
        # int4: within a block of rows, bytes are [columns, rows / 2]: gather whole columns per block
        half = e * inp // 2
        flat_bytes = q.packed.reshape(-1)
        pieces = []
        for seg in self.segments:
            at = seg.row * half
            data = flat_bytes[at : at + seg.blocks * seg.size * half].view(seg.blocks, e, inp, seg.size // 2)
            pieces.append(data.index_select(1, flat).reshape(-1))
        packed = torch.cat(pieces).view(out, p * inp // 2)
        groups = inp // q.group_size  # scales [E * in / group, out, 2], expert-major
        return packed, q.scales.view(e, groups, out, 2).index_select(0, flat).reshape(p * groups, out, 2)


def gathered(
    fc1: QuantStack, fc2: QuantStack, geglu: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
) -> torch.Tensor:
    """moe.MoE.gathered on quantized stacks: [T, dim] -> [T, dim] from the routed experts only."""
    t, k = experts.shape
    flat = experts.reshape(-1)  # pair p = token * k + j
    u = fc1.gathered(h, flat)  # [T, P * 2 inner]: every row times every pair's expert
    if t > 1:
        rows = torch.arange(t, device=h.device)
        u = u.view(t, t, -1)[rows, rows]  # each row's own k pairs
    g = geglu(u.view(t, k, -1)) * weights[..., None]  # [T, k, inner], routing-weighted
    x = g.reshape(t, -1)
    if t > 1:  # row r's pairs in its own columns, zeros in the other rows' (block diagonal)
        x = (torch.eye(t, dtype=x.dtype, device=x.device)[:, :, None] * x[None]).reshape(t, -1)
    return fc2.gathered(x, flat)


def dense(
    fc1: QuantStack, fc2: QuantStack, geglu: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
) -> torch.Tensor:
    """moe.MoE.dense on quantized stacks: every expert over every row, weighted by the routing."""
    t, num = h.shape[0], fc1.experts
    u = fc1(h).view(t, num, -1)  # [T, E, 2 inner]
    routing = torch.zeros(t, num, dtype=h.dtype, device=h.device).scatter(1, experts, weights)
    return fc2((geglu(u) * routing[..., None]).reshape(t, -1))
