"""Device check for Moondream 2 on a CUDA machine (CI has no GPU; run where one is lent).

    python -m benchmarks.device_check_moondream [--fixture ../shared/fixtures/moondream2-tiny] [--out DIR]

Checks, each printed as PASS/FAIL and written to DIR/device_check_moondream.json:
1. fp32 on CUDA (TF32 off) answers caption / query / detect / point exactly as fp32 on CPU, on a tiny random
   checkpoint (foveal.testing.moondream) and, when `--fixture` is given, the fixture's recorded answers.
2. pipelined == blocking on CUDA (fp32), detect / point / caption sharing the batch.
3. bf16 on CUDA (the default dtype) loads and answers well-formed results (reported, not compared).
4. No host synchronisation in a decode step with region rows: the forward and the region sampler run
   under `torch.cuda.set_sync_debug_mode("error")`.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import foveal
from foveal.families.moondream.answers import GATE, SIZE
from foveal.testing import moondream


def _images() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        (rng.random(shape) * 255).astype(np.uint8) for shape in ((200, 300, 3), (500, 900, 3), (64, 64, 3))
    ]


def _answers(model, image) -> dict:
    return {
        "objects": model.detect(image, "red car", settings={"max_objects": 4})["objects"],
        "points": model.point(image, "blue dot", settings={"max_objects": 3})["points"],
        "caption": model.caption(image, settings={"max_tokens": 8})["caption"],
        "answer": model.query(image, "what is this?", settings={"max_tokens": 8})["answer"],
    }


def cuda_matches_cpu(folder: Path) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with foveal.load(folder, device="cpu") as cpu, foveal.load(folder, device="cuda", dtype="float32") as gpu:
        rows = [(_answers(cpu, im), _answers(gpu, im)) for im in _images()]
    return {"ok": all(a == b for a, b in rows), "mismatches": [i for i, (a, b) in enumerate(rows) if a != b]}


def fixture_answers(fixture: Path) -> dict:
    figures = json.loads((fixture / "figures.json").read_text())
    failures = []
    with foveal.load(fixture, device="cuda", dtype="float32") as model:
        for name, fig in figures["images"].items():
            image = fixture / fig["image"]["file"]
            got = model.point(image, "tok1011 tok77", settings={"max_objects": 3})["points"]
            if got != fig["point"]["result"]:
                failures.append((name, "point", got))
            ids = model.family.tokenizer.decode(fig["caption_normal"]["greedy_ids"], skip_special_tokens=True)
            if model.caption(image, settings={"max_tokens": 12})["caption"] != ids:
                failures.append((name, "caption"))
    return {"ok": not failures, "failures": failures}


def pipelined_equals_blocking(folder: Path) -> dict:
    with (
        foveal.load(folder, device="cuda", dtype="float32") as a,
        foveal.load(folder, device="cuda", dtype="float32", pipelined=False) as b,
    ):
        same = [_answers(a, im) == _answers(b, im) for im in _images()]
    return {"ok": all(same)}


def bf16_runs(folder: Path) -> dict:
    with foveal.load(folder, device="cuda") as model:
        out = _answers(model, _images()[1])
    return {
        "ok": len(out["objects"]) == 4 and len(out["points"]) == 3,
        "dtype": "bfloat16",
        "sample": out["points"],
    }


def no_host_sync(folder: Path) -> dict:
    """A decode launch whose rows feed a token, a coordinate and a size, then the region sampler."""
    from foveal.engine.runner import ForwardBatch

    with foveal.load(folder, device="cuda") as model:
        model.query(_images()[0], "warm up", settings={"max_tokens": 4})  # kernels warmed outside the check
        runner = model.family.runner
        v, cuda = runner.vocab_size, torch.device("cuda")
        batch = ForwardBatch(
            input_ids=torch.tensor([1, v + 3, v + 2000], device=cuda),
            positions=torch.tensor([5, 5, 5], device=cuda),
            query_start=torch.arange(4, dtype=torch.int32, device=cuda),
            context_lens=torch.tensor([6, 6, 6], dtype=torch.int32, device=cuda),
            block_tables=torch.tensor([[0], [1], [2]], dtype=torch.int32, device=cuda),
            kv_index=torch.tensor([5, 21, 37], device=cuda),
            max_query_len=1,
            max_context_len=6,
        )
        kinds = torch.tensor([GATE, SIZE, 0], device=cuda)
        rows = torch.tensor([0, 1], device=cuda)
        sampled = torch.zeros(3, dtype=torch.int64, device=cuda)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        error = None
        try:
            logits = runner.forward(batch)
            sampled.copy_(logits.argmax(dim=-1))
            runner.sample_regions(runner.last_hidden, kinds, rows, sampled)
        except RuntimeError as exc:
            error = str(exc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return {"ok": error is None, "error": error}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixture", type=Path, default=None)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        folder = moondream.build(Path(tmp) / "tiny")
        report = {
            "cuda_fp32_matches_cpu": cuda_matches_cpu(folder),
            "pipelined_equals_blocking": pipelined_equals_blocking(folder),
            "bf16_runs": bf16_runs(folder),
            "no_host_sync": no_host_sync(folder),
        }
        if args.fixture is not None:
            report["fixture_answers_fp32"] = fixture_answers(args.fixture)
    for name, row in report.items():
        print(f"{'PASS' if row['ok'] else 'FAIL'} {name} {row}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "device_check_moondream.json").write_text(json.dumps(report, indent=2, default=str))
    return 0 if all(row["ok"] for row in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
