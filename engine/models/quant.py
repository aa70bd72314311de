"""Weight-only int8 / int4 linear layers: small weights, faster decode on CPU.

PROBLEM
    A decode step at batch 1 reads every weight once: it is memory-bound, so its time is the bytes of
    the weights. SmolLM2-135M in fp32 is 540 MB a step; its GGUF file holds the same weights in 4 bits
    (Q4_1) and 8 bits (Q8_0), 98 MB in all. Dequantizing them to fp32 at load throws the saving away.

SOLUTION
    `QuantLinear` replaces an `nn.Linear` and keeps its weight packed for one of torch's weight-only
    CPU kernels, which dequantize inside the matmul:
      - "int4": `_weight_int4pack_mm_for_cpu`, groups of `group_size` (32) input features with a scale
        and a zero each: w = (q - 8) * scale + zero, q in 0..15. GGUF's Q4_0 (w = d * (q - 8)) and Q4_1
        (w = d * q + m) map onto it exactly: scale = d, zero = 0 or m + 8 d.
      - "int8": `_weight_int8pack_mm`, one scale per output feature: w = q * scale, q in -127..127.
        GGUF's Q8_0 (one scale per 32 weights) is requantized onto it (per-row scale; the rounding
        error is at most half a step of the row's scale).
    Which kernel wins depends on the rows and the CPU: at batch 1 both weight-only kernels beat a
    dense fp32 matmul by reading fewer bytes, and both are an order of magnitude slower with fp32
    activations than with bf16 ones, so quantized models compute in bf16. So quantized kernels
    serve decode (few rows; from `DENSE_ROWS` rows on, one dense matmul of the dequantized weight is
    faster); `quantize_model` applies them to the decoder's linear layers (int4 or int8) and to the
    LM head (always int8: the head decides every token). `QuantEmbedding` reads token rows from the
    head's int8 weight when the two are tied, so a tied model keeps one 8-bit copy of its
    vocabulary matrix.

    `HalfLinear` ("fp16") keeps the weight as fp16 in fbgemm's packed layout and multiplies float32
    activations by it (`quantized::linear_dynamic_fp16`: fp16 weights converted in registers, fp32
    arithmetic). A step then reads half the fp32 bytes, and its activations are exact, so its greedy
    answers are the fp32 weights' (bf16 activations change them). It is the default for a GGUF on
    x86 CPUs (loader.py); it needs torch's fbgemm backend (`fp16_kernel_available`). fbgemm's int8
    dynamic linear is not used: it quantizes activations per tensor, which outlier activations (as
    SmolLM2 has) make far too coarse. `python -m benchmarks.models` measures the modes on a real
    checkpoint.

    `SplitLinear` holds both: the int4 groups for launches of at most `FEW_ROWS` rows (bf16 only
    at the kernel's input and output, float32 everywhere else) and the fp16 pack for more rows. It
    is what a GGUF's Q4 blocks become by default on x86 (gguf.py): decode reads 4-bit weights, a
    prefill or a large batch runs fbgemm. The choice of kernels and the crossover are measured in
    docs/quantization.md (torchao adds no CPU kernel of its own; inductor's code for a weight-only
    matmul compiled for a minute and ran slower). `FusedInt4` (`fuse_int4`) runs several int4
    layers over one input, a decoder's q/k/v or gate/up, as one launch with the same groups, so
    that a batch-1 step pays one dispatch and two conversions for them instead of one per layer.

INVARIANTS
    - `dequantize()` returns exactly the weight the kernel multiplies by (up to the kernel's own
      float rounding): tests compare `forward` with `x @ dequantize().T`.
    - Activations keep their dtype; scales and zeros are stored in the compute dtype the kernels
      require (fp32 or bf16).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from foveal.engine.models import int4_layout

QUANT_MODES = ("int8", "int4", "fp16")
# From this many rows on, QuantLinear dequantizes and runs one dense fp32 matmul instead of the
# weight-only kernel: the kernels' cost grows with the rows, a dequantize is paid once per launch
# (int4's unpacking costs more, so its crossover is later).
DENSE_ROWS = {"int8": 32, "int4": 128}
GROUP_SIZE = 32  # GGUF's block size; the int4 kernel takes 32, 64, 128 or 256


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W held as int8 (per output row scale) or int4 (per group scale and zero)."""

    packed: torch.Tensor  # buffers (register_buffer in __init__), typed for the checker
    scales: torch.Tensor

    def __init__(
        self,
        mode: str,
        packed: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None = None,
        group_size: int = GROUP_SIZE,
    ) -> None:
        super().__init__()
        if mode not in QUANT_MODES:
            raise ValueError(f"quantization mode {mode!r}: use one of {QUANT_MODES}")
        self.mode, self.group_size = mode, group_size
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", packed)  # int8 [N, K] or the int4 kernel's uint8 [N, K / 2]
        self.register_buffer("scales", scales)  # int8: [N]; int4: [K / group, N, 2] (scale, zero)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def int8_from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> QuantLinear:
        """Symmetric per-row int8 of a float weight [N, K]."""
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls("int8", q, scale.to(dtype), w.shape[1], w.shape[0], _bias(bias, dtype))

    @classmethod
    def int4_from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, group_size: int = GROUP_SIZE
    ) -> QuantLinear:
        """Asymmetric int4 per group of `group_size` input features (min/max of each group)."""
        w = weight.detach().float()
        n, k = w.shape
        check_int4_shape(n, k, group_size)
        groups = w.view(n, k // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        return cls.int4_from_codes(
            q.view(n, k).to(torch.int32), scale, low + 8 * scale, bias, dtype, group_size
        )

    @classmethod
    def int4_from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        group_size: int = GROUP_SIZE,
    ) -> QuantLinear:
        """codes int32 [N, K] in 0..15; scale, zero [N, K / group]: w = (codes - 8) * scale + zero."""
        n, k = codes.shape
        check_int4_shape(n, k, group_size)
        packed = pack_int4(codes)
        scales = torch.stack([scale.float(), zero.float()], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls("int4", packed, scales, k, n, _bias(bias, dtype), group_size)

    @classmethod
    def int8_from_codes(
        cls, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> QuantLinear:
        """codes int8 [N, K]; scale [N]: w = codes * scale."""
        return cls(
            "int8", codes.contiguous(), scale.to(dtype), codes.shape[1], codes.shape[0], _bias(bias, dtype)
        )

    # -- use -----------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] >= DENSE_ROWS[self.mode]:
            # Many rows (prefill, big batches): the weight-only kernels scale badly with rows here,
            # a dequantized fp32 weight and one dense matmul less so (DENSE_ROWS). Traces fix the
            # row count, so a traced bucket holds one of the two paths.
            out = F.linear(flat.float(), self.dequantize()).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        if self.mode == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.packed, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def int4_mm(self, flat: torch.Tensor) -> torch.Tensor:
        """The int4 kernel alone on a flat [rows, in_features] input of the scales' dtype (no bias,
        no reshapes: a few ops fewer per launch in a traced step, where each op costs its dispatch)."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this layer multiplies by."""
        if self.mode == "int8":
            return self.packed.float() * self.scales.float()[:, None]
        n, k = self.out_features, self.in_features
        found = int4_layout.layout(n)
        if found is not None:
            codes = found.unpack(self.packed).view(n, k // self.group_size, self.group_size)
            scale, zero = self.scales.float().permute(1, 0, 2).unbind(-1)  # [N, K / group] each
            return ((codes.float() - 8) * scale[..., None] + zero[..., None]).view(n, k)
        # A layout the block model does not describe: unpack through the kernel, W.T = identity @ W.T.
        eye = torch.eye(self.in_features, dtype=self.scales.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group_size, self.scales
        ).T.float()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.mode == "int4" else ""
        return f"{self.mode}, in_features={self.in_features}, out_features={self.out_features}{group}"


FP16_UNAVAILABLE = "quantize='fp16' runs on torch's fbgemm backend, which this torch build lacks; use 'int8' or 'int4'"


def fp16_kernel_available() -> bool:
    """Whether torch has fbgemm (x86 builds), whose packed fp16 GEMM `HalfLinear` runs on."""
    return "fbgemm" in torch.backends.quantized.supported_engines


# fbgemm's fp16 GEMM runs a launch's rows in blocks of up to 6, and its 1- and 2-row blocks round
# differently from the others: a decode row's output would differ from the same row's in a launch of
# 3 to 6 rows (a speculative verify launch, or a few calls batched), flipping near-ties of greedy
# decoding. Launches of fewer rows are padded to this many, so that up to 6 rows a row's output is
# the same whatever shares its launch; the pad costs nothing measurable, the weight's bytes dominate.
MIN_HALF_ROWS = 3


class HalfLinear(nn.Module):
    """y = x @ W.T + b with W held as fp16 in fbgemm's packed layout; x and y are float32."""

    mode = "fp16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not fp16_kernel_available():
            raise ValueError(FP16_UNAVAILABLE)
        self.out_features, self.in_features = weight.shape
        # A TorchScript object, not a tensor: traces reach it as an attribute of this module (traced.py).
        self.packed = torch.ops.quantized.linear_prepack_fp16(
            weight.detach().float().contiguous(), None if bias is None else bias.detach().float()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = int(flat.shape[0])  # a constant of a traced step (which fixes its rows), not an item() per replay
        if rows < MIN_HALF_ROWS:  # the same micro-kernel as a launch of a few more rows (MIN_HALF_ROWS)
            flat = F.pad(flat, (0, 0, 0, MIN_HALF_ROWS - rows))
            out = torch.ops.quantized.linear_dynamic_fp16(flat, self.packed)[:rows]
        else:
            out = torch.ops.quantized.linear_dynamic_fp16(flat, self.packed)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this layer multiplies by (the fp16 values)."""
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]

    def nbytes(self) -> int:
        return 2 * self.in_features * self.out_features

    def extra_repr(self) -> str:
        return f"fp16, in_features={self.in_features}, out_features={self.out_features}"


# Launches of at most this many rows run SplitLinear's int4 kernel, larger ones its fp16 GEMM: the
# int4 kernel reads a quarter of fp16's bytes but costs more per row (docs/quantization.md).
FEW_ROWS = 4


class SplitLinear(nn.Module):
    """y = x @ W.T for float32 x, with W held twice: int4 groups for launches of at most `FEW_ROWS`
    rows (decode), fbgemm fp16 for more (prefill, large batches).

    A decode step reads every weight once, so at a few rows the int4 kernel, reading a quarter of
    fp16's bytes, is the faster one; its cost grows with the rows faster than fbgemm's, which wins
    from `FEW_ROWS` on. The int4 kernel wants bf16 activations (fp32 or fp16 ones take 10-15x
    longer), so the few-row path rounds its input to bf16 and returns float32: the rest of the model
    (norms, attention, the KV cache, the head) stays float32. Traces fix the row count, so a traced
    bucket holds one of the two paths."""

    mode = "int4+fp16"

    def __init__(self, int4: QuantLinear, half: HalfLinear) -> None:
        super().__init__()
        if int4.mode != "int4" or int4.weight_dtype != torch.bfloat16 or int4.bias is not None:
            raise ValueError("SplitLinear takes an int4 QuantLinear with bf16 scales and no bias")
        if (int4.out_features, int4.in_features) != (half.out_features, half.in_features):
            raise ValueError("SplitLinear's two layers must hold weights of one shape")
        self.int4, self.fp16 = int4, half
        self.in_features, self.out_features = half.in_features, half.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if x.shape[0] > FEW_ROWS:
            return self.fp16(x)
        return self.int4.int4_mm(x.to(torch.bfloat16)).to(x.dtype)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x) for a float32 residual [rows, out_features] and x [rows, in_features],
        bit for bit: the int4 path's bf16 output is added as it is (float32 + bf16 computes in
        float32, the bf16 values converted exactly), one conversion op fewer than `forward`'s."""
        if x.shape[0] > FEW_ROWS or residual.dtype != torch.float32:
            return residual + self(x)
        return residual + self.int4.int4_mm(x.to(torch.bfloat16))

    def dequantize(self, rows: int = 1) -> torch.Tensor:
        """The float32 weight [N, K] a launch of `rows` rows multiplies by."""
        return self.int4.dequantize() if rows <= FEW_ROWS else self.fp16.dequantize()

    def nbytes(self) -> int:
        return self.int4.nbytes() + self.fp16.nbytes()

    def extra_repr(self) -> str:
        return f"int4 up to {FEW_ROWS} rows, fp16 above, in_features={self.in_features}, out_features={self.out_features}"


class FusedInt4(nn.Module):
    """Several int4 layers over one input (a layer's q/k/v, or gate/up) run as one int4 launch.

    The int4 kernel's cost per launch is more than its weights' bytes at one row: a dispatch, and
    for `SplitLinear` parts two bf16 conversions, each paid per projection. Concatenating the
    parts' output features makes one launch of the same groups and codes; each output column is
    reduced over the same inputs in the same order as in its own layer, so the outputs are the
    parts' own, bit for bit. The parts' packed codes become views of the fused tensor (one copy of
    the weights in memory, the parts still usable on their own, e.g. by transformers' forward).
    Launches beyond the parts' int4 rows (`SplitLinear`: more than `FEW_ROWS`) run the parts.

    Build them with `fuse_int4`, which says None where the parts cannot be fused."""

    def __init__(self, parts: list[QuantLinear | SplitLinear], int4: QuantLinear) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.int4 = int4
        self.sizes = [p.out_features for p in parts]
        self.in_features, self.out_features = int4.in_features, int4.out_features
        self.split = isinstance(parts[0], SplitLinear)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.dim() != 2:
            outs = self(x.reshape(-1, self.in_features))
            return tuple(out.view(*x.shape[:-1], n) for out, n in zip(outs, self.sizes, strict=True))
        out = self.joined(x)
        if out is None:
            return tuple(part(x) for part in self.parts)
        return out.split(self.sizes, dim=-1)

    def joined(self, x: torch.Tensor) -> torch.Tensor | None:
        """The parts' outputs side by side, [rows, out_features] in x's dtype, from one launch over
        x [rows, in_features]; None where the parts run on their own (`SplitLinear` parts beyond
        `FEW_ROWS` rows). lean.py rotates q and k as one slice of it."""
        if not self.split:  # int4 QuantLinears: their own rows logic, on the fused weight
            return self.int4(x)
        if x.shape[0] > FEW_ROWS:
            return None
        return self.int4.int4_mm(x.to(torch.bfloat16)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"int4 over {self.sizes} output features, in_features={self.in_features}"


def fuse_int4(groups: list[list[nn.Module]]) -> list[FusedInt4 | None]:
    """One int4 launch for each group of layers over one input (FusedInt4), or None for a group
    whose layers cannot share one: not all int4 `QuantLinear`s or all `SplitLinear`s, different
    inputs, groups or dtypes, a bias on some only, or a row count whose packed layout is not known
    (`int4_layout`).

    Where torch's layout on this CPU lets the parts' packed codes be laid end to end (every part
    whole blocks of it: real models' widths, multiples of 64), they are, and the parts read views of
    the fused codes: one copy in memory. Otherwise the codes are unpacked, joined and packed again
    for the fused row count, and the parts keep their own (a second copy of those layers). The
    fused codes of every group go into one allocation, copied by numpy (`_concatenate`): an
    allocation per group and torch's parallel copies were slow on a loaded machine."""
    plans = [_int4_parts(parts) for parts in groups]
    buffer = torch.empty(sum(q.packed.numel() for int4s in plans if int4s for q in int4s), dtype=torch.uint8)
    fused: list[FusedInt4 | None] = []
    at = 0
    for parts, int4s in zip(groups, plans, strict=True):
        if int4s is None:
            fused.append(None)
            continue
        first = int4s[0]
        rows = sum(q.out_features for q in int4s)
        packed = buffer[at : at + rows * first.packed.shape[1]].view(rows, first.packed.shape[1])
        at += packed.numel()
        if int4_layout.joins([q.out_features for q in int4s]):
            np.concatenate([q.packed.numpy() for q in int4s], out=packed.numpy())
            start = 0
            for q in int4s:  # the parts read the fused codes: one copy in memory
                q.packed = packed[start : start + q.out_features]
                start += q.out_features
        else:
            codes = torch.cat([_layout_of(q).unpack(q.packed) for q in int4s])
            packed.copy_(pack_int4(codes))
        scales = _concatenate([q.scales for q in int4s], dim=1)  # [K / group, N, 2]
        # every part has a bias if the first has (_int4_parts)
        bias = None if first.bias is None else torch.cat([cast(nn.Parameter, q.bias).detach() for q in int4s])
        int4 = QuantLinear("int4", packed, scales, first.in_features, rows, bias, first.group_size)
        fused.append(FusedInt4(cast("list[QuantLinear | SplitLinear]", parts), int4))  # as _int4_parts found
    return fused


def _layout_of(q: QuantLinear) -> int4_layout.Layout:
    found = int4_layout.layout(q.out_features)
    assert found is not None, "_int4_parts admits only layers whose layout is known"
    return found


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _concatenate(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat by numpy (bits as integers: numpy has no bf16): one thread, where torch's copies
    run parallel regions that wait, on a loaded machine, for a preempted thread (several times
    longer: docs/performance.md, "Measurements behind the code's choices")."""
    as_int = _INT_OF_SIZE[tensors[0].element_size()]
    joined = np.concatenate([t.view(as_int).numpy() for t in tensors], axis=dim)
    return torch.from_numpy(joined).view(tensors[0].dtype)


def _int4_parts(parts: list[nn.Module]) -> list[QuantLinear] | None:
    """The int4 layers of `parts` if one launch can run them all (fuse_int4), else None."""
    if len(parts) < 2:
        return None
    if all(isinstance(p, SplitLinear) for p in parts):
        int4s = [cast(SplitLinear, p).int4 for p in parts]
    elif all(isinstance(p, QuantLinear) and p.mode == "int4" for p in parts):
        int4s = cast("list[QuantLinear]", list(parts))
    else:
        return None
    first = int4s[0]
    same = all(
        (q.in_features, q.group_size, q.weight_dtype, q.packed.dtype)
        == (first.in_features, first.group_size, first.weight_dtype, torch.uint8)
        and int4_layout.layout(q.out_features) is not None
        and (q.bias is None) == (first.bias is None)
        for q in int4s
    )
    return int4s if same else None


class HalfEmbedding(nn.Module):
    """Token embeddings stored as fp16, looked up as float32 (a GGUF's vocabulary matrix under "fp16")."""

    weight: torch.Tensor  # a buffer (register_buffer in __init__), typed for the checker

    def __init__(self, weight: torch.Tensor, padding_idx: int | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().to(torch.float16))
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()


def builder() -> ThreadPoolExecutor:
    """A pool on torch's intra-op thread count, to build layers in parallel: quantizing and packing
    release the GIL, and fbgemm's fp16 packing alone is seconds of a load on one thread (docs/performance.md)."""
    return ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="foveal-load")


class QuantEmbedding(nn.Module):
    """Token embeddings read from an int8 `QuantLinear` (a tied head): rows are dequantized on lookup."""

    def __init__(self, head: QuantLinear, padding_idx: int | None = None) -> None:
        super().__init__()
        if head.mode != "int8":
            raise ValueError("QuantEmbedding reads int8 rows; an int4 head has no row-wise layout")
        self.head = head
        self.padding_idx = padding_idx
        self.embedding_dim = head.in_features
        self.num_embeddings = head.out_features

    @property
    def weight(self) -> torch.Tensor:
        """A float copy, for code that asks a model's input embeddings for their weight (rarely: tests)."""
        return self.head.dequantize().to(self.head.weight_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.head.packed).to(self.head.scales.dtype)
        return rows * self.head.scales[ids].unsqueeze(-1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (0..15) in the layout of `_convert_weight_to_int4pack_for_cpu`.

    The layout is torch's on this CPU, derived from its converter (`int4_layout`), and packed by
    a few vectorised ops from the codes' own dtype (the converter wants an int32 copy of them);
    a row count whose layout is not known goes through the converter itself."""
    found = int4_layout.layout(codes.shape[0])
    if found is None:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    return found.pack(codes)


def check_int4_shape(n: int, k: int, group_size: int) -> None:
    if n % 16:
        raise ValueError(
            f"int4 needs out_features divisible by 16 (torch's int4 kernel); got {n}. Use quantize='int8' for this model"
        )
    if k % group_size or group_size not in (32, 64, 128, 256):
        raise ValueError(
            f"int4 needs in_features divisible by the group size (32, 64, 128 or 256); got {k} and {group_size}. "
            "Use quantize='int8' for this model"
        )


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if bias is None else bias.detach().to(dtype)


def quantize_linear(linear: nn.Linear, mode: str, dtype: torch.dtype) -> QuantLinear | HalfLinear:
    if mode == "fp16":
        return HalfLinear(linear.weight, linear.bias)
    if mode == "int8":
        return QuantLinear.int8_from_float(linear.weight, linear.bias, dtype)
    return QuantLinear.int4_from_float(linear.weight, linear.bias, dtype)


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Replace the text decoder's linear layers by `mode` layers and the LM head, in place.

    "int8" / "int4": QuantLinears, and an int8 head; a head tied to the input embeddings is
    quantized once and the embeddings read its int8 rows (`QuantEmbedding`). "fp16": HalfLinears,
    the head included, on a float32 model (the kernel's activations); tied embeddings keep their
    float32 rows. Vision towers and projectors stay as they are: they run once per image.
    Raises ValueError (before changing anything) when a layer's shape or the model's dtype does
    not suit `mode`.
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"quantize={mode!r}: use None, {', '.join(repr(m) for m in QUANT_MODES)}")
    dtype = next(model.parameters()).dtype
    if mode == "fp16" and dtype != torch.float32:
        raise ValueError(f"quantize='fp16' multiplies float32 activations; the model is {dtype} (load it in float32)")
    if mode == "fp16" and not fp16_kernel_available():
        raise ValueError(FP16_UNAVAILABLE)
    # a transformers model: its decoder and heads (nn.Module types its attributes Tensor | Module)
    decoder = model.get_decoder()  # type: ignore[operator]
    linears = [
        (parent, name, child)
        for parent in decoder.layers.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    if mode == "int4":
        for _, _, child in linears:
            check_int4_shape(child.out_features, child.in_features, GROUP_SIZE)
    with builder() as pool:
        built = list(pool.map(lambda item: quantize_linear(item[2], mode, dtype), linears))
    for (parent, name, _), layer in zip(linears, built, strict=True):
        setattr(parent, name, layer)
    head = model.get_output_embeddings()  # type: ignore[operator]
    embed = model.get_input_embeddings()  # type: ignore[operator]
    if isinstance(head, nn.Linear):
        if mode == "fp16":
            model.set_output_embeddings(HalfLinear(head.weight, head.bias))  # type: ignore[operator]
            return model
        tied = embed is not None and head.weight.data_ptr() == embed.weight.data_ptr()
        quantized = QuantLinear.int8_from_float(head.weight, head.bias, dtype)
        model.set_output_embeddings(quantized)  # type: ignore[operator]
        if tied and type(embed) is nn.Embedding:  # a scaled embedding (Gemma) keeps its own float rows
            model.set_input_embeddings(QuantEmbedding(quantized, embed.padding_idx))  # type: ignore[operator]
    return model
