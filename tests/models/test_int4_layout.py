"""torch's int4 layout derived from its converter (engine/models/int4_layout.py), on every CPU kind
torch can run here: this CPU's own kernels, AVX2's (ATEN_CPU_CAPABILITY=avx2 selects them on an
AVX-512 machine) and the plain ones. Each kind runs in its own process: torch reads the variable once."""

import json
import os
import subprocess
import sys

import pytest
import torch

from foveal.engine.models import int4_layout

ROWS = (16, 32, 48, 64, 80, 96, 112, 128, 192, 576, 1552)

CHECK = r"""
import json, sys, torch
from foveal.engine.models import int4_layout
from foveal.engine.models.quant import QuantLinear, fuse_int4
convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
rows = json.loads(sys.argv[1])
result = {"capability": torch.backends.cpu.get_cpu_capability(), "packs": True, "joins": True, "fused": True}
gen = torch.Generator().manual_seed(0)
for n in rows:
    layout = int4_layout.layout(n)
    for k in (2, 64, 96):
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        packed = layout.pack(codes)
        result["packs"] &= torch.equal(packed, convert(codes, 1)) and torch.equal(layout.unpack(packed).int(), codes)
for sizes in ([64, 32, 32], [32, 64], [128, 64, 64], [576, 192, 192], [48, 16]):
    codes = [torch.randint(0, 16, (n, 64), dtype=torch.int32, generator=gen) for n in sizes]
    laid = torch.cat([convert(c, 1) for c in codes])
    result["joins"] &= int4_layout.joins(sizes) == torch.equal(laid, convert(torch.cat(codes), 1))
    torch.manual_seed(len(sizes))
    parts = [QuantLinear.int4_from_float(torch.randn(n, 96), None, torch.bfloat16) for n in sizes]
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = [p(x) for p in parts]
        (fused,) = fuse_int4([parts])
        result["fused"] &= fused is not None and all(
            torch.equal(a, b) for a, b in zip(fused(x), before, strict=True)
        )
        result["fused"] &= all(torch.equal(p(x), b) for p, b in zip(parts, before, strict=True))
print(json.dumps(result))
"""


def _kinds() -> list[str]:
    own = torch.backends.cpu.get_cpu_capability().lower()
    return sorted({"default", "avx2", own} if own != "default" else {"default"})


@pytest.mark.parametrize("kind", _kinds())
def test_layout_packs_unpacks_joins_and_fuses_as_torch_on_each_cpu_kind(kind):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": kind}
    out = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(ROWS)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["capability"].lower() == kind
    assert result == {**result, "packs": True, "joins": True, "fused": True}


def test_layout_is_blocks_of_this_cpus_kernel_width():
    """On this process's kernels: whole blocks of 64 rows (AVX-512) or 32 (AVX2, plain), a partial
    last block in row pairs; widths in multiples of 64 always join."""
    block = 64 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 32
    found = int4_layout.layout(1536 + 16)
    assert [(s.row, s.blocks, s.size) for s in found.segments] == [(0, 1536 // block, block), (1536, 1, 16)]
    assert found.segments[-1].low == tuple(range(0, 16, 2))  # pairs of rows: even low, odd high
    assert int4_layout.joins([576, 192, 192]) and int4_layout.joins([1536, 1536])


def test_row_counts_the_kernel_refuses_have_no_layout():
    assert int4_layout.layout(8) is None and int4_layout.layout(0) is None
    with pytest.raises(ValueError, match="divisible by 16"):
        from foveal.engine.models.quant import QuantLinear

        QuantLinear.int4_from_float(torch.randn(24, 64), None, torch.bfloat16)
