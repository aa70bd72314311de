"""Weight-only int8/int4 layers and fp16 layers (engine/models/quant.py), `load(quantize=)`, and the
lean forward's scope."""

import pytest
import torch

from foveal.engine.models import ModelLoadError
from foveal.engine.models.lean import LeanDecoder
from foveal.engine.models.quant import (
    HalfEmbedding,
    HalfLinear,
    QuantEmbedding,
    QuantLinear,
    fp16_kernel_available,
    pack_int4,
)
from foveal.families import load
from foveal.testing import parity, tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quant_linear_multiplies_by_its_dequantized_weight(mode, dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 96), torch.randn(64)
    make = QuantLinear.int8_from_float if mode == "int8" else QuantLinear.int4_from_float
    layer = make(weight, bias, dtype)
    x = torch.randn(5, 96, dtype=dtype)
    expected = x.float() @ layer.dequantize().T + bias
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(layer(x).float(), expected, atol=tol * expected.abs().max())
    # the stored weight is the original within half a quantization step
    step = (
        weight.abs().amax(1, keepdim=True) / 127
        if mode == "int8"
        else (weight.amax(1, keepdim=True) - weight.amin(1, keepdim=True)) / 15
    )
    assert bool(((layer.dequantize() - weight).abs() <= step / 2 + 1e-2).all())


def test_int4_codes_and_groups_are_exact():
    """GGUF's Q4_1 (w = d q + m) maps onto the kernel exactly: scale d, zero m + 8 d."""
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (32, 64), dtype=torch.int32)
    d, m = torch.rand(32, 2), torch.randn(32, 2)
    layer = QuantLinear.int4_from_codes(codes, d, m + 8 * d, None, torch.float32)
    expected = codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    assert torch.allclose(layer.dequantize(), expected, atol=1e-5)


@pytest.mark.parametrize("shape", [(32, 64), (48, 64), (64, 128), (80, 32), (96, 576)])
def test_int4_packing_matches_torchs_converter(shape):
    codes = torch.randint(0, 16, shape, dtype=torch.int32)
    assert torch.equal(pack_int4(codes), torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))


def test_embedding_reads_the_heads_int8_rows():
    torch.manual_seed(0)
    head = QuantLinear.int8_from_float(torch.randn(50, 32), None, torch.float32)
    ids = torch.tensor([3, 0, 49])
    assert torch.allclose(QuantEmbedding(head)(ids), head.dequantize()[ids])


@pytest.mark.parametrize(("mode", "min_cosine"), [("int8", 0.999), ("int4", 0.9)])
def test_quantized_llama_decodes_close_to_fp32(checkpoints, mode, min_cosine):
    """Tiny random Llama: quantized logits point where fp32's do; the lean forward runs quantized layers.

    (Random Gaussian weights are the worst case for 16 levels per group; the real SmolLM2 numbers
    are in the slow GGUF test.)"""
    reference = load(checkpoints["llama"], device="cpu")
    loaded = load(checkpoints["llama"], device="cpu", quantize=mode)
    assert loaded.runner.dtype == torch.bfloat16  # weight-only kernels run with bf16 activations
    assert loaded.runner.lean is not None
    layers = loaded.runner.model.get_decoder().layers
    assert all(
        isinstance(getattr(layer.mlp, n), QuantLinear) for layer in layers for n in ("gate_proj", "up_proj")
    )
    assert isinstance(loaded.runner.model.get_output_embeddings(), QuantLinear)
    prompts = [loaded.processor(p) for p in tiny.PROMPTS[:3]]
    ours = parity.greedy(loaded.runner, prompts, 1).logits
    theirs = parity.greedy(reference.runner, [reference.processor(p) for p in tiny.PROMPTS[:3]], 1).logits
    for a, b in zip(ours, theirs, strict=True):
        assert float(torch.nn.functional.cosine_similarity(a[0], b[0], dim=0)) > min_cosine


def test_quantize_is_checked_before_any_weight_is_read(checkpoints):
    with pytest.raises(
        ModelLoadError, match=r"quantize='int3' is not supported; use None .*'int8', 'int4' or 'fp16'"
    ):
        load(checkpoints["llama"], device="cpu", quantize="int3")


def test_lean_forward_covers_every_family_and_can_be_turned_off(checkpoints):
    for family in ("llama", "gemma", "paligemma", "idefics3", "llava"):
        assert load(checkpoints[family], device="cpu").runner.lean is not None, family
    from foveal.engine.models.runner import HFRunner

    loaded = load(checkpoints["llama"], device="cpu")
    off = HFRunner(loaded.runner.model, loaded.runner.arch, lean=False)
    assert off.lean is None
    prompts = [loaded.processor(p) for p in tiny.PROMPTS[:3]]
    assert parity.greedy(off, prompts, 4).logits_close(parity.greedy(loaded.runner, prompts, 4), atol=1e-5)


def test_lean_refuses_layers_it_does_not_reproduce(checkpoints):
    loaded = load(checkpoints["llama"], device="cpu")
    assert LeanDecoder.supports(loaded.runner.model)
    loaded.runner.model.config.final_logit_softcapping = 30.0  # Gemma 2: not reproduced
    assert not LeanDecoder.supports(loaded.runner.model)


def test_foveal_load_passes_quantize_down_and_checks_it_first(checkpoints):
    import foveal

    with pytest.raises(ModelLoadError, match="quantize='fp8' is not supported"):
        foveal.load(checkpoints["llama"], device="cpu", quantize="fp8")
    with foveal.load(checkpoints["llama"], device="cpu", quantize="int8", max_model_len=64) as model:
        assert isinstance(model.family.runner.model.get_output_embeddings(), QuantLinear)
        out = model.generate(None, "hello", None, {"temperature": 0.0, "max_tokens": 4})
        assert isinstance(out["text"], str)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_many_rows_take_the_dense_path_with_the_same_weight(mode, monkeypatch):
    from foveal.engine.models import quant

    torch.manual_seed(0)
    make = QuantLinear.int8_from_float if mode == "int8" else QuantLinear.int4_from_float
    layer = make(torch.randn(64, 96), torch.randn(64), torch.bfloat16)
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    kernel = layer(x)
    monkeypatch.setitem(quant.DENSE_ROWS, mode, 1)
    dense = layer(x)
    assert dense.dtype == torch.bfloat16
    assert torch.allclose(dense.float(), kernel.float(), atol=0.05 * float(kernel.abs().max()))


def test_half_linear_multiplies_float32_by_the_fp16_weight():
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 96), torch.randn(64)
    layer = HalfLinear(weight, bias)
    assert torch.equal(layer.dequantize(), weight.half().float())  # the weight it holds: fp16 values
    x = torch.randn(3, 5, 96)
    expected = x @ weight.half().float().T + bias
    out = layer(x)
    assert out.shape == (3, 5, 64) and out.dtype == torch.float32
    assert torch.allclose(out, expected, atol=1e-4 * float(expected.abs().max()))
    assert layer.nbytes() == 2 * 64 * 96
    rows = HalfEmbedding(weight)(torch.tensor([[3, 0]]))
    assert rows.dtype == torch.float32 and torch.equal(rows[0], weight.half().float()[[3, 0]])


def test_fp16_llama_decodes_like_fp32_through_traced_steps(checkpoints):
    """Tiny random Llama under quantize="fp16": every linear and the head are HalfLinears, the
    activations stay float32, and greedy decoding (decode launches replay traced graphs, which
    must reach the fbgemm packs) gives fp32's tokens with logits within fp16 weight rounding."""
    reference = load(checkpoints["llama"], device="cpu")
    loaded = load(checkpoints["llama"], device="cpu", quantize="fp16")
    runner = loaded.runner
    assert runner.dtype == torch.float32 and runner.lean is not None and runner.decode_graphs is not None
    layers = runner.model.get_decoder().layers
    assert all(isinstance(layer.self_attn.q_proj, HalfLinear) for layer in layers)
    assert isinstance(runner.model.get_output_embeddings(), HalfLinear)
    prompts = [loaded.processor(p) for p in tiny.PROMPTS[:3]]
    ours = parity.greedy(parity.trace_in_launch(runner), prompts, 6)
    theirs = parity.greedy(reference.runner, [reference.processor(p) for p in tiny.PROMPTS[:3]], 6)
    assert loaded.runner.decode_graphs.graphs  # decode went through traces
    assert ours.tokens == theirs.tokens
    assert ours.logits_close(theirs, atol=2e-2)


def test_fp16_is_refused_where_it_cannot_run(checkpoints, monkeypatch):
    with pytest.raises(ModelLoadError, match="quantize='fp16' multiplies float32 activations"):
        load(checkpoints["llama"], device="cpu", quantize="fp16", dtype="bfloat16")
    monkeypatch.setattr("foveal.engine.models.loader.fp16_kernel_available", lambda: False)  # e.g. aarch64
    with pytest.raises(ModelLoadError, match="fbgemm backend.*use 'int8' or 'int4'"):
        load(checkpoints["llama"], device="cpu", quantize="fp16")


def _split(n: int = 64, k: int = 96, seed: int = 0):
    from foveal.engine.models.quant import SplitLinear

    torch.manual_seed(seed)
    weight = torch.randn(n, k)
    int4 = QuantLinear.int4_from_float(weight, None, torch.bfloat16)
    return SplitLinear(int4, HalfLinear(int4.dequantize())), int4


@pytest.mark.skipif(not fp16_kernel_available(), reason="SplitLinear's many-row path is fbgemm's")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 64])
def test_split_linear_takes_int4_for_few_rows_and_fp16_for_many(rows, monkeypatch):
    """The rows choose the kernel (FEW_ROWS: int4 at or below, fp16 above), and either path
    multiplies float32 activations by its own dequantized weight and returns float32. Tolerance:
    the int4 path rounds x and y to bf16 (2^-8 relative each), so |error| <= 2^-7 of sum |x| |w|;
    the fp16 path is exact products of fp16 weights, float32 sums (1e-5 of it)."""
    from foveal.engine.models import quant

    layer, int4 = _split()
    x = torch.randn(rows, 96)
    used = []
    monkeypatch.setattr(int4, "int4_mm", lambda flat: used.append("int4") or QuantLinear.int4_mm(int4, flat))
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 64)
    assert used == (["int4"] if rows <= quant.FEW_ROWS else [])
    weight = layer.dequantize(rows)
    scale = x.abs() @ weight.abs().T
    tolerance = 2.0**-7 if rows <= quant.FEW_ROWS else 1e-5
    assert bool(((out - x @ weight.T).abs() <= tolerance * scale + 1e-6).all())


@pytest.mark.skipif(not fp16_kernel_available(), reason="SplitLinear's many-row path is fbgemm's")
def test_split_linear_keeps_the_shape_of_its_input_and_refuses_mismatched_halves():
    from foveal.engine.models.quant import SplitLinear

    layer, int4 = _split()
    assert layer(torch.randn(2, 3, 96)).shape == (2, 3, 64)
    with pytest.raises(ValueError, match="one shape"):
        SplitLinear(int4, HalfLinear(torch.randn(32, 96)))
    with pytest.raises(ValueError, match="bf16 scales"):
        fp32_scales = QuantLinear.int4_from_float(torch.randn(64, 96), None, torch.float32)
        SplitLinear(fp32_scales, HalfLinear(torch.randn(64, 96)))


def _parts(kind: str, sizes=(64, 32, 32), k: int = 96, bias: bool = False):
    """Layers over one input, as a decoder's q/k/v: SplitLinears, or int4 QuantLinears (bf16)."""
    from foveal.engine.models.quant import SplitLinear

    torch.manual_seed(1)
    parts = []
    for n in sizes:
        int4 = QuantLinear.int4_from_float(
            torch.randn(n, k), torch.randn(n) if bias else None, torch.bfloat16
        )
        parts.append(SplitLinear(int4, HalfLinear(int4.dequantize())) if kind == "split" else int4)
    return parts


@pytest.mark.skipif(not fp16_kernel_available(), reason="SplitLinear's many-row path is fbgemm's")
@pytest.mark.parametrize("kind", ["split", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
@pytest.mark.parametrize("sizes", [(64, 32, 32), (128, 64, 64)])
def test_fused_int4_gives_each_part_its_own_output_bit_for_bit(kind, rows, sizes):
    """One int4 launch over the parts' concatenated output features reduces each column over the
    same inputs in the same order: the outputs are the parts' own, exactly, at every row count
    (above FEW_ROWS a SplitLinear fusion runs the parts' fp16), and the parts still give what they
    gave before. Where this CPU's layout lets the packed parts be laid end to end (widths in
    multiples of 64 on every CPU torch knows), the parts read views of the fused codes."""
    from foveal.engine.models import int4_layout
    from foveal.engine.models.quant import fuse_int4

    parts = _parts(kind, sizes=sizes, bias=kind == "int4")
    dtype = torch.float32 if kind == "split" else torch.bfloat16
    x = torch.randn(2, rows, 96).to(
        dtype
    )  # a leading batch dimension, as the lean forward's [T, hidden] or more
    with torch.inference_mode():
        before = [part(x) for part in parts]
        (fused,) = fuse_int4([parts])
        assert fused is not None
        outs = fused(x)
        after = [part(x) for part in parts]
    assert len(outs) == len(parts)
    for out, a, b in zip(outs, before, after, strict=True):
        assert out.dtype == dtype and out.shape == a.shape
        assert torch.equal(out, a) and torch.equal(b, a)
    storage = fused.int4.packed.untyped_storage().data_ptr()
    int4s = [p.int4 if kind == "split" else p for p in parts]
    shared = [q.packed.untyped_storage().data_ptr() == storage for q in int4s]
    joined = int4_layout.joins(list(sizes))
    assert shared == [joined] * len(parts)  # one copy of the codes where the layout allows it
    if sizes == (128, 64, 64):
        assert joined


def test_fuse_int4_refuses_parts_that_cannot_share_a_launch():
    from foveal.engine.models.quant import fuse_int4

    split = _parts("split", sizes=(64, 32))
    int4 = _parts("int4", sizes=(64, 32))
    assert fuse_int4([[split[0], int4[1]]]) == [None]  # a SplitLinear and a bare int4 layer
    assert fuse_int4([[split[0], HalfLinear(torch.randn(32, 96))]]) == [None]  # a Q8_0 layer kept as fp16
    assert fuse_int4([[int4[0], _parts("int4", sizes=(32,), k=128)[0]]]) == [None]  # other inputs
    assert fuse_int4([[int4[0], _parts("int4", sizes=(48,))[0]]]) != [None]  # any layout: repacked if need be
    assert fuse_int4([[int4[0], _parts("int4", sizes=(32,), bias=True)[0]]]) == [None]  # a bias on one only
    assert fuse_int4([int4[:1]]) == [None]
    # several groups at once: None where a group cannot fuse, one allocation for the codes of the rest
    first, refused, second = fuse_int4([int4, [split[0], int4[1]], _parts("int4", sizes=(32, 32))])
    assert refused is None and first is not None and second is not None
    storage = first.int4.packed.untyped_storage().data_ptr()
    assert second.int4.packed.untyped_storage().data_ptr() == storage


def test_lean_forward_runs_qkv_and_gate_up_as_one_int4_launch_each(checkpoints, monkeypatch):
    """Tiny random Llama under quantize="int4": a decode step makes 4 int4 launches a layer (q/k/v,
    o, gate/up, down) instead of 7, and greedy decoding through traced steps gives the tokens and
    logits of the separate projections, exactly."""
    loaded = load(checkpoints["llama"], device="cpu", quantize="int4")
    runner = loaded.runner
    prompts = [loaded.processor(p) for p in tiny.PROMPTS[:3]]
    fused = parity.greedy(parity.trace_in_launch(runner), prompts, 5)
    runner.lean = LeanDecoder(runner.model, fuse=False)
    separate = parity.greedy(parity.trace_in_launch(runner), prompts, 5)
    assert fused.tokens == separate.tokens
    assert all(
        torch.equal(a, b)
        for x, y in zip(fused.logits, separate.logits, strict=True)
        for a, b in zip(x, y, strict=True)
    )

    layers = runner.model.config.num_hidden_layers
    launches = []
    forward = QuantLinear.forward
    monkeypatch.setattr(QuantLinear, "forward", lambda self, x: launches.append(self) or forward(self, x))
    runner.decode_graphs = None  # eager, so that each launch is a Python call
    batch = parity.make_batch([([3], 5, [0, 1], None)], 4, "cpu")
    for lean, per_layer in ((LeanDecoder(runner.model, fuse=False), 7), (LeanDecoder(runner.model), 4)):
        launches.clear()
        runner.lean = lean
        runner.forward(batch)
        head = runner.model.get_output_embeddings()
        assert len([q for q in launches if q is not head]) == per_layer * layers
