"""Device check for Moondream 2 on a CUDA machine (CI has no GPU; run where one is lent).

    python -m benchmarks.device_check_moondream [--fixture ../shared/fixtures/moondream2-tiny] [--out DIR]
    python -m benchmarks.device_check_moondream --fixture ... --device cpu   # checks 5-6 only: a CPU dry run

Checks, each printed as PASS/FAIL and written to DIR/device_check_moondream.json:
1. fp32 on CUDA (TF32 off) answers caption / query / detect / point exactly as fp32 on CPU, on a tiny random
   checkpoint (foveal.testing.moondream) and, when `--fixture` is given, the fixture's recorded answers.
2. pipelined == blocking on CUDA (fp32), detect / point / caption sharing the batch.
3. bf16 on CUDA (the default dtype) loads and answers well-formed results (reported, not compared).
4. No host synchronisation in a decode step with region rows: the forward and the region sampler run
   under `torch.cuda.set_sync_debug_mode("error")`.
5. With `--fixture`: the remaining skills (figures_skills.json) in fp32 on the device, through the public
   API: grounded reasoning on the `skills` weights (coordinates decoded by the region heads in the
   pipeline), spatial refs, detect_gaze (a point and None) and the LoRA variant beside base calls on one
   image, pipelined and blocking, and all of them sharing the batch from threads.
6. No host synchronisation in a decode step with a reasoning (THINK) row and a LoRA-variant row.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

import foveal
from foveal.families.moondream.answers import GATE, SIZE, THINK
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


SKILLS_QUESTION = "tok588 tok900 tok469 tok382"
VARIANT = "tiny-lora-a"


def skills_folder(fixture: Path, into: Path) -> Path:
    """The fixture with its `skills` weights (lm_head replaced by skills_lm_head.safetensors)."""
    from safetensors.torch import load_file, save_file

    into.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(fixture / name, into / name)
    shutil.copytree(fixture / "variants", into / "variants", dirs_exist_ok=True)
    state = load_file(fixture / "model.safetensors")
    state.update(load_file(fixture / "skills_lm_head.safetensors"))
    save_file(state, into / "model.safetensors", metadata={"format": "pt"})
    return into


def _skills_calls(base, skills, fixture: Path, figures: dict) -> list:
    """(label, call, expected) for every recorded skill of every image."""
    greedy = {"max_tokens": 12}
    decode = base.family.tokenizer.decode
    calls = []
    for name, fig in figures["images"].items():
        image = fixture / "images" / f"{name}.png"
        for weights, model in (("base", base), ("skills", skills)):
            rec = fig["reasoning"][weights]["with_standin_tokenizer"]
            calls.append((f"{name}.reasoning.{weights}",
                          lambda m=model, i=image: m.query(i, SKILLS_QUESTION, reasoning=True, settings=greedy),
                          {"reasoning": rec["reasoning"], "answer": rec["answer"]}))
            for k, gaze in enumerate(fig["detect_gaze"][weights]):
                calls.append((f"{name}.gaze.{weights}.{k}",
                              lambda m=model, i=image, e=tuple(gaze["eye"]): m.detect_gaze(i, eye=e),
                              {"gaze": gaze["gaze"]}))
        for case, refs in figures["settings"]["spatial_refs"].items():
            want = decode(fig["spatial_refs"][case]["greedy_ids"], skip_special_tokens=True)
            calls.append((f"{name}.spatial_refs.{case}",
                          lambda i=image, r=refs: base.query(i, SKILLS_QUESTION, spatial_refs=r, settings=greedy)["answer"],
                          want))
        for mode, variant in (("variant", VARIANT), ("no_variant", None)):
            want = decode(fig["lora"][mode]["caption_normal"]["greedy_ids"], skip_special_tokens=True)
            settings = {**greedy, "variant": variant} if variant else greedy
            calls.append((f"{name}.lora.{mode}.caption",
                          lambda i=image, s=settings: base.caption(i, settings=s)["caption"], want))
            points = fig["lora"][mode]["point"]["result"]
            settings = {"max_objects": 3, "variant": variant} if variant else {"max_objects": 3}
            calls.append((f"{name}.lora.{mode}.point",
                          lambda i=image, s=settings: [{"x": p["x"], "y": p["y"]}
                                                       for p in base.point(i, "tok1011 tok77", settings=s)["points"]],
                          points))
    return calls


def _all_at_once(calls: list) -> dict:
    """Every call from its own thread at once (they share the engine's batches): label -> result."""
    out: dict = {}
    threads = [threading.Thread(target=lambda lb=lb, c=c: out.__setitem__(lb, c())) for lb, c, _ in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def skills_answers(fixture: Path, device: str) -> dict:
    """Check 5: every recording of figures_skills.json, alone and then all at once from threads."""
    torch.backends.cuda.matmul.allow_tf32 = False
    figures = json.loads((fixture / "figures_skills.json").read_text())
    failures: list = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = skills_folder(fixture, Path(tmp) / "skills")
        for pipelined in (True, False):
            with (
                foveal.load(fixture, device=device, dtype="float32", pipelined=pipelined) as base,
                foveal.load(folder, device=device, dtype="float32", pipelined=pipelined) as skills,
            ):
                calls = _skills_calls(base, skills, fixture, figures)
                for label, call, want in calls:
                    answer = call()
                    if answer != want:
                        failures.append((label, pipelined, "alone", answer))
                shared = _all_at_once(calls)
                failures += [(lb, pipelined, "shared", shared.get(lb)) for lb, _, want in calls if shared.get(lb) != want]
    return {"ok": not failures, "calls": 2 * 2 * len(calls), "failures": failures[:10]}


def no_host_sync_skills(fixture: Path, device: str) -> dict:
    """Check 6: a decode launch with a THINK row and a variant row (LoRA per row), then the region sampler."""
    from foveal.engine.runner import ForwardBatch

    with foveal.load(fixture, device=device, dtype="float32") as model:
        image = fixture / "images" / "small_64x64.png"
        model.caption(image, settings={"max_tokens": 2, "variant": VARIANT})  # loads the variant, warms kernels
        runner = model.family.runner
        dev = torch.device(device)
        runner.page_variant[1] = 1  # sequence 1's first page: a variant's
        batch = ForwardBatch(
            input_ids=torch.tensor([1, 2], device=dev),
            positions=torch.tensor([5, 5], device=dev),
            query_start=torch.arange(3, dtype=torch.int32, device=dev),
            context_lens=torch.tensor([6, 6], dtype=torch.int32, device=dev),
            block_tables=torch.tensor([[0], [1]], dtype=torch.int32, device=dev),
            kv_index=torch.tensor([5, 21], device=dev),
            max_query_len=1,
            max_context_len=6,
        )
        kinds = torch.tensor([THINK, 0], device=dev)
        rows = torch.tensor([0], device=dev)
        sampled = torch.full((2,), runner.config.tokenizer.coord_id, dtype=torch.int64, device=dev)
        error = None
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            runner.forward(batch)
            runner.sample_regions(runner.last_hidden, kinds, rows, sampled)
        except RuntimeError as exc:
            error = str(exc)
        finally:
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        runner.page_variant[1] = 0
        coordinate = int(sampled[0]) >= runner.vocab_size  # the coord token became a coordinate value
    return {"ok": error is None and coordinate, "error": error, "think_row_is_a_coordinate": coordinate}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixture", type=Path, default=None)
    parser.add_argument("--out", default=".")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of checks 5-6 (needs --fixture)")
    args = parser.parse_args()
    if args.device == "cpu":
        if args.fixture is None:
            print("--device cpu runs checks 5-6, which need --fixture")
            return 1
        report = {
            "skills_answers_fp32": skills_answers(args.fixture, "cpu"),
            "no_host_sync_skills": no_host_sync_skills(args.fixture, "cpu"),
        }
        return _report(report, args.out)
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
            report["skills_answers_fp32"] = skills_answers(args.fixture, "cuda")
            report["no_host_sync_skills"] = no_host_sync_skills(args.fixture, "cuda")
    return _report(report, args.out)


def _report(report: dict, out: str) -> int:
    for name, row in report.items():
        print(f"{'PASS' if row['ok'] else 'FAIL'} {name} {row}")
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "device_check_moondream.json").write_text(json.dumps(report, indent=2, default=str))
    return 0 if all(row["ok"] for row in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
