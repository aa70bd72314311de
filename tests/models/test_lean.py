"""The lean decoder's own ops (engine/models/lean.py): its RMSNorm and rotary forms against torch's and
transformers', a row's rotary independent of its launch, SplitLinear.add_to against forward, and a
traced decode step of a quantized GGUF that replays no item() and no no-op conversion per layer."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from foveal.engine.models.lean import LeanDecoder, _Norm, _Rotary
from foveal.engine.models.quant import FEW_ROWS, HalfLinear, QuantLinear, SplitLinear, fp16_kernel_available
from foveal.engine.models.traced import DecodeGraphs
from foveal.families import load
from foveal.testing import parity

needs_fbgemm = pytest.mark.skipif(not fp16_kernel_available(), reason="SplitLinear's many-row path is fbgemm's")


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_norm_is_rms_norm_up_to_float32_rounding(scale):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=generator) * scale
    weight = torch.rand(96, generator=generator) + 0.5
    norm = _Norm(weight, 1e-5)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (96,), weight, 1e-5), rtol=1e-6, atol=0)
    # the epsilon counts as in torch's: a row of zeros and a tiny row normalise the same way
    tiny = torch.cat([torch.zeros(1, 96), torch.full((1, 96), 1e-4)])
    torch.testing.assert_close(norm(tiny), F.rms_norm(tiny, (96,), weight, 1e-5), rtol=1e-6, atol=0)


def test_norm_of_bf16_activations_is_torchs():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
    weight = (torch.rand(64, generator=generator) + 0.5).to(torch.bfloat16)
    assert torch.equal(_Norm(weight, 1e-6)(x), F.rms_norm(x, (64,), weight, 1e-6))


def _cos_sin(checkpoints, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    model = load(checkpoints["llama"], device="cpu").runner.model
    x = torch.zeros(len(positions), 1)
    cos, sin = model.get_decoder().rotary_emb(x, torch.tensor([positions]))
    return cos[0], sin[0]


def test_rotary_is_transformers_rope_up_to_float32_rounding(checkpoints):
    positions = [0, 7, 300, 5000, 9, 64]
    cos, sin = _cos_sin(checkpoints, positions)
    x = torch.randn(len(positions), 4, cos.shape[-1], generator=torch.Generator().manual_seed(2))
    # transformers' own: q and k [B, H, T, D], cos/sin [B, T, D]
    reference, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(_Rotary(cos, sin, cos.shape[-1])(x), reference[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_a_rows_rotary_does_not_depend_on_its_launch_nor_on_the_other_heads(checkpoints):
    """Each row of a launch (speculative verify launches) and each head (q and k rotated as one
    tensor or apart: fused and separate projections) gets what it gets alone, bit for bit."""
    positions = [3, 17, 250, 4000]
    cos, sin = _cos_sin(checkpoints, positions)
    qk = torch.randn(len(positions), 6, cos.shape[-1], generator=torch.Generator().manual_seed(3))
    together = _Rotary(cos, sin, cos.shape[-1])(qk)
    q, k = _Rotary(cos, sin, cos.shape[-1])(qk[:, :4]), _Rotary(cos, sin, cos.shape[-1])(qk[:, 4:])
    assert torch.equal(together, torch.cat([q, k], dim=1))
    for row in range(len(positions)):
        alone = _Rotary(cos[row : row + 1], sin[row : row + 1], cos.shape[-1])(qk[row : row + 1])
        assert torch.equal(alone[0], together[row]), row


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS, FEW_ROWS + 2])
def test_split_linear_add_to_is_the_residual_plus_forward_bit_for_bit(rows):
    generator = torch.Generator().manual_seed(4)
    int4 = QuantLinear.int4_from_float(torch.randn(64, 96, generator=generator), None, torch.bfloat16)
    layer = SplitLinear(int4, HalfLinear(int4.dequantize()))
    x, residual = torch.randn(rows, 96, generator=generator), torch.randn(rows, 64, generator=generator)
    with torch.inference_mode():
        out = layer.add_to(residual, x)
        assert out.dtype == torch.float32
        assert torch.equal(out, residual + layer(x))


def _replayed_graph(runner, layers: int) -> torch.Graph:
    """The inlined graph of a traced one-row decode step over the first `layers` decoder layers."""
    runner.lean = LeanDecoder(runner.model)
    runner.lean.layers = runner.lean.layers[:layers]
    graphs = DecodeGraphs(runner._eager, runner.model, background=False)
    batch = parity.make_batch([([3], 6, [0, 1], None)], runner.kv.page_size, "cpu")
    with torch.inference_mode():
        graphs(batch, runner.kv.k, runner.kv.v, runner.kv.page_size, runner.kv.scratch_page)
    (graph,) = set(graphs.graphs.values())
    return graph.inlined_graph


@needs_fbgemm
def test_a_decode_replay_reads_no_shape_and_converts_nothing_in_vain_per_layer(tmp_path):
    """A traced step's layers hold no aten::Int (an item() per replay: a shape read as a traced
    value) and no aten::to that leaves the dtype as it is (a dispatch per replay that does nothing):
    a step of two layers has as many as a step of one. The GGUF's default kernels (SplitLinear int4
    projections, an fp16 head) are the case of SmolLM2."""
    pytest.importorskip("gguf")
    from tests.models.test_gguf_tiny import LAYERS, write_tiny_gguf

    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", tied=True, seed=0)
    runner = load(tiny.path, device="cpu", runner="torch").runner
    assert isinstance(runner.model.get_decoder().layers[0].mlp.up_proj, SplitLinear)
    runner.allocate_kv(16, 4)
    one, every = _replayed_graph(runner, 1), _replayed_graph(runner, LAYERS)
    per_layer = Counter(n.kind() for n in every.nodes()) - Counter(n.kind() for n in one.nodes())
    assert per_layer["aten::_weight_int4pack_mm_for_cpu"] > 0  # the layers are there
    assert per_layer["aten::Int"] == 0 and per_layer["aten::item"] == 0
    assert per_layer["aten::to"] > 0  # the layers' bf16 conversions around the int4 kernel

    def in_vain(graph: torch.Graph) -> list[torch.Node]:
        return [
            n for n in graph.nodes()
            if n.kind() == "aten::to" and n.inputsAt(0).type().scalarType() == n.output().type().scalarType()
        ]

    assert len(in_vain(every)) == len(in_vain(one)), in_vain(every)  # none in a layer
