"""Moondream 3's decode step on CPU: the mixture of experts computed as the runner does (gathered or
dense for decode, no loop per expert) against a per-expert Python loop.

    python -m benchmarks.moe_decode [--rows 1 4 16] [--context 760] [--steps 30] [--out out/benchmarks/moe_decode.json]

For each config (`tiny`: the moondream3-tiny fixture's dims, 8 experts top-2; `small`: 64 experts top-8
as the real model routes, narrow dims) and each batch size, a Moondream 3 runner with random weights
(float32) decodes one token per row over a context of --context positions (an image prefix and a
prompt), and the table gives the median milliseconds of one decode step for:
    runner   the runner's own strategy (gathered while rows * k <= experts, else dense), eager;
    loop     the same step with every MoE layer as a loop over the experts (moe.MoE.looped), eager;
    traced   the runner's strategy replayed as the traced decode graph (what the CPU engine runs).
The CPU model (benchmarks.run.cpu_model), thread count and versions are recorded with the figures.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks import write_json
from benchmarks.run import cpu_model
from foveal.engine.runner import ForwardBatch
from foveal.families.moondream.config import MoondreamConfig
from foveal.families.moondream.load import MOONDREAM
from foveal.families.moondream.moe import MoE
from foveal.families.moondream.runner import MoondreamRunner
from foveal.families.moondream.weights import MoondreamWeights

PAGE = 16
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {  # the fixture's text dims
        "text": {"dim": 128, "ff_dim": 256, "n_layers": 4, "vocab_size": 1024, "n_heads": 2, "n_kv_heads": 2,
                 "moe": {"num_experts": 8, "start_layer": 2, "experts_per_token": 2, "expert_inner_dim": 64}},
    },
    "small": {  # the real routing (64 experts, top 8, MoE from layer 4) on narrow dims
        "text": {"dim": 256, "ff_dim": 1024, "n_layers": 8, "vocab_size": 2048, "n_heads": 4, "n_kv_heads": 4,
                 "moe": {"num_experts": 64, "start_layer": 4, "experts_per_token": 8, "expert_inner_dim": 128}},
    },
}
MODES = ("runner", "loop", "traced")
VISION = {"enc_dim": 32, "enc_n_layers": 27, "enc_ff_dim": 64, "enc_n_heads": 2, "proj_inner_dim": 128}


def build_runner(name: str, trace: bool) -> MoondreamRunner:
    entry = {**CONFIGS[name], "vision": {**VISION, "proj_out_dim": CONFIGS[name]["text"]["dim"]},
             "region": {"dim": CONFIGS[name]["text"]["dim"], "coord_feat_dim": 32, "size_feat_dim": 64}}
    config = MoondreamConfig.from_dict(entry, 3)
    torch.manual_seed(0)
    weights = MoondreamWeights(config)
    for p in weights.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return MoondreamRunner(weights, MOONDREAM, trace_decode=trace)


def decode_batch(rows: int, context: int) -> ForwardBatch:
    """One decode row per sequence; sequence i owns pages [i * per, (i + 1) * per)."""
    per = -(-context // PAGE)
    positions = torch.full((rows,), context - 1, dtype=torch.int64)
    tables = torch.arange(rows * per, dtype=torch.int32).view(rows, per)
    kv_index = tables[:, -1].to(torch.int64) * PAGE + (context - 1) % PAGE
    return ForwardBatch(
        input_ids=torch.randint(10, 500, (rows,)),
        positions=positions,
        query_start=torch.arange(rows + 1, dtype=torch.int32),
        context_lens=torch.full((rows,), context, dtype=torch.int32),
        block_tables=tables,
        kv_index=kv_index,
        max_query_len=1,
        max_context_len=context,
        prefill=[],
    )


@contextmanager
def looped_experts():
    """Every MoE layer as the per-expert loop, for the duration (the benchmark's baseline)."""
    original = MoE.forward
    MoE.forward = lambda self, h, decode: self.looped(h, *self.route(h))  # type: ignore[method-assign]
    try:
        yield
    finally:
        MoE.forward = original  # type: ignore[method-assign]


def timed_ms(runner: MoondreamRunner, batch: ForwardBatch, looped: bool) -> float:
    start = time.perf_counter()
    if looped:
        with looped_experts():
            runner.forward(batch)
    else:
        runner.forward(batch)
    return (time.perf_counter() - start) * 1e3


def measure(name: str, rows: int, context: int, steps: int) -> dict[str, float]:
    """Median ms of the three modes, measured interleaved step by step (a shared CPU's noise hits all alike)."""
    batch = decode_batch(rows, context)
    pages = rows * -(-context // PAGE) + 1
    runners = {mode: build_runner(name, trace=mode == "traced") for mode in MODES}
    for runner in runners.values():
        runner.allocate_kv(pages, PAGE)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for step in range(steps + 3):  # 3 warm-up steps (and, traced, the trace itself)
        for mode, runner in runners.items():
            ms = timed_ms(runner, batch, mode == "loop")
            if step >= 3:
                times[mode].append(ms)
    for runner in runners.values():
        runner.quiesce()
    out = {mode: statistics.median(t) for mode, t in times.items()}
    out["loop / runner"] = out["loop"] / out["runner"]
    out["loop / traced"] = out["loop"] / out["traced"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=760)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--out", default="out/benchmarks/moe_decode.json")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "cpu": cpu_model(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "context": args.context, "steps": args.steps, "results": [],
    }
    print(f"CPU {report['cpu']}, {report['torch_threads']} torch threads; median ms per decode step")
    print(f"{'config':6s} {'rows':>4s} {'runner':>8s} {'loop':>8s} {'traced':>8s} {'loop/runner':>11s} "
          f"{'loop/traced':>11s}")
    with torch.inference_mode():
        for name in args.configs:
            for rows in args.rows:
                row = {"config": name, "rows": rows, **measure(name, rows, args.context, args.steps)}
                report["results"].append(row)
                print(f"{name:6s} {rows:4d} {row['runner']:8.2f} {row['loop']:8.2f} {row['traced']:8.2f} "
                      f"{row['loop / runner']:11.2f} {row['loop / traced']:11.2f}")
    print(f"wrote {write_json(args.out, report)}")
    return report


if __name__ == "__main__":
    main()
