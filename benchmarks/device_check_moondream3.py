"""Device check for Moondream 3 on a CUDA machine (CI has no GPU; run where one is lent).

    python -m benchmarks.device_check_moondream3 [--fixture ../shared/fixtures/moondream3-tiny] [--out DIR]
    python -m benchmarks.device_check_moondream3 --device cpu [--quick]     # the same checks on CPU: a dry run

Sections (`--sections`, all by default), each printed as a table and written to
DIR/device_check_moondream3.json (DIR: --out, else $OUT, else out/benchmarks):
1. parity (float32, TF32 off for matmul and cuDNN) against the moondream3-tiny fixture:
   `prefill_logits`: every recorded prompt whose logits are figures.safetensors' `<call>.prompt_last_logits`
   (captions, query, reasoning, detect, point, gaze, spatial refs of every image, and the text-only
   prompts) in ONE prefill launch of the loaded runner, each within the README's 1e-4 absolute;
   `api_results`: through `foveal.load(fixture, device=...)`, pipelined and blocking, the base and the
   skills weights: every recorded result (caption short/normal, query, reasoning and its answer,
   detect, point, detect_gaze, spatial refs), each call alone and then every image's calls at once
   from threads (sharing the engine's batches), compared exactly;
   `no_host_sync`: decode launches on the gathered and the dense MoE path with token, gate and size
   rows, then the region sampler, under `torch.cuda.set_sync_debug_mode("error")` (on CPU the same
   launches run without that mode: a check of the script, not of syncs).
2. moe: the mixture-of-experts paths of families/moondream/moe.py (gathered, dense, grouped) against
   the per-expert loop (`looped`, the oracle) at the tiny config (benchmarks.moe_decode's, the fixture's
   dims) and at the real Moondream 3 sizes (MoondreamConfig's defaults: dim 2048, 64 experts, top 8,
   expert inner 1024), random weights: agreement in float32 and bfloat16 within MOE_TOLERANCE
   (relative to the output's largest magnitude), and the median ms of one MoE layer (routing included)
   per decode step at 1, 4, 16, 64 rows in bfloat16 for each path and for `forward` (what the runner
   does); a decode step's MoE cost is that times the MoE layers (reported).
3. e2e: the tiny model in bfloat16 through the public API, pipelined vs blocking: a batch of captions
   on distinct random images (prefill ms, tokens/s).

The report records the device's name and torch's version. Exit status: 0 all checks passed, 1 a parity
or agreement check failed (or, on CUDA, the run took over LIMIT_S: shrink the sizes here), 2 no CUDA
device (without --device cpu) or no fixture. Sized for well under LIMIT_S on one H200: the CPU dry run
of the same sizes (minus the real-size MoE, which CPU skips unless --real-moe) is the estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

import foveal
from benchmarks import write_json
from benchmarks.moe_decode import CONFIGS as MOE_DECODE_CONFIGS
from foveal import families
from foveal.families.moondream.answers import GATE, SIZE
from foveal.families.moondream.config import MoeConfig, MoondreamConfig
from foveal.families.moondream.moe import MoE, grouped_mm_runs
from foveal.families.moondream.processor import Coord, MoondreamPrompt, Size
from foveal.testing import parity

LIMIT_S = 5 * 60
FIXTURE = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "moondream3-tiny"  # ../shared
LOGIT_TOLERANCE = 1e-4  # the fixture README's absolute rule for float32
MOE_TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}  # max |path - looped| / max |looped|: summation order, bf16 rounding
MOE_PATHS = ("gathered", "dense", "grouped", "grouped_mm", "looped", "forward")
CANDIDATES = ("gathered", "dense", "grouped", "grouped_mm")  # looped is the oracle: it syncs with the host
PAGE = 16


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def exact_float32() -> None:
    """Parity needs IEEE float32 matmuls: TF32 rounds their inputs to a 10-bit mantissa, far coarser
    than the fixture's 1e-4 absolute tolerance was measured for (float32, no TF32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# ---- 1. parity ---------------------------------------------------------------------------------------------


def figures(fixture: Path, which: str = "figures") -> dict:
    return json.loads((fixture / f"{which}.json").read_text())


def recorded_prompts(fixture: Path) -> list[tuple[str, list, str | None]]:
    """(key of its logits in figures.safetensors, prompt parts after BOS, image name or None) per prefill."""
    fig = figures(fixture)
    gaze = fig["settings"]["gaze_strings"]  # the ids around the eye's coordinates
    out: list[tuple[str, list, str | None]] = []
    for name, calls in fig["images"].items():
        for call in ("caption_short", "caption_normal", "query", "reasoning", "detect", "point"):
            out.append((f"{name}.{call}", calls[call]["prompt_ids"], name))
        for k in (0, 1):
            x, y = calls[f"detect_gaze_{k}"]["eye_as_bfloat16"]
            out.append((f"{name}.detect_gaze_{k}", [*gaze["\n\nPoint:"], Coord(x), Coord(y), *gaze[" gaze\n\n"]], name))
        for case in fig["settings"]["spatial_refs_cases"]:
            out.append((f"{name}.spatial_refs_{case}", _with_refs(calls[f"spatial_refs_{case}"]), name))
    for call in ("query", "reasoning"):  # text only: the recorded ids start with BOS, no image
        out.append((f"text_only.{call}", fig["text_only"][call]["prompt_ids"], None))
    return out


def _with_refs(fig: dict) -> list:
    """The recorded prompt with its coord / size placeholders replaced by the references' values."""
    parts: list = []
    for ref in fig["spatial_refs"]:
        if len(ref) == 2:
            parts += [Coord(ref[0]), Coord(ref[1])]
        else:
            x1, y1, x2, y2 = ref
            parts += [Coord((x1 + x2) / 2), Coord((y1 + y2) / 2), Size(x2 - x1, y2 - y1)]
    ids, at = fig["prompt_ids"], fig["coord_token_positions"] + fig["size_token_positions"]
    return [*ids[: min(at)], *parts, *ids[max(at) + 1 :]]


def prefill_logits(family, fixture: Path) -> dict:
    """Every recorded prompt in one varlen prefill launch of the family's runner (its own KV pool)."""
    from safetensors.torch import load_file

    runner, processor = family.runner, family.processor
    items, keys, start = [], [], 0
    for key, parts, image in recorded_prompts(fixture):
        if image is None:
            token_ids, inputs = parts, None
        else:
            pil = Image.open(fixture / "images" / f"{image}.png")
            prompt = processor(MoondreamPrompt(tuple(parts)), pil, image_key=image)  # each image encoded once
            token_ids, inputs = prompt.token_ids, prompt.prefill
        pages = -(-len(token_ids) // PAGE)
        items.append((token_ids, 0, list(range(start, start + pages)), inputs))
        keys.append(key)
        start += pages
    runner.allocate_kv(start + 8, PAGE)
    logits = runner.forward(parity.make_batch(items, PAGE, runner.device)).float().cpu()
    ref = load_file(fixture / "figures.safetensors")
    diffs = {k: float((logits[i] - ref[f"{k}.prompt_last_logits"]).abs().max()) for i, k in enumerate(keys)}
    worst = max(diffs, key=diffs.get)
    failures = {k: d for k, d in diffs.items() if not d <= LOGIT_TOLERANCE}
    return {"ok": not failures, "prompts": len(keys), "tokens": sum(len(i[0]) for i in items),
            "max_diff": diffs[worst], "worst": worst, "tolerance": LOGIT_TOLERANCE, "failures": failures}


def _text(model, ids: list[int]) -> str:
    return model.family.tokenizer.decode(ids, skip_special_tokens=True)


def _unscored(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "score"} for item in items]


def expected(model, fig: dict, settings: dict) -> dict:
    """The recorded results of one image, in the public API's shapes (boxes clipped to [0, 1] as the
    SDK returns them; the reference's are not)."""
    out: dict = {}
    for call in ("caption_short", "caption_normal", "query"):
        if call in fig:
            out[call] = _text(model, fig[call]["greedy_ids"])
    reasoning = fig["reasoning"]
    out["reasoning"] = {
        "reasoning": {"text": "".join(_text(model, c) for c in reasoning["chunks"]),
                      "grounding": reasoning["reasoning"]["grounding"]},
        "answer": _text(model, reasoning["answer"]["greedy_ids"]),
    }
    out["detect"] = [{k: min(1.0, max(0.0, v)) for k, v in box.items()} for box in fig["detect"]["result"]]
    out["point"] = fig["point"]["result"]
    for k in (0, 1):
        out[f"gaze_{k}"] = fig[f"detect_gaze_{k}"]["gaze"]
    for case in settings["spatial_refs_cases"]:
        if f"spatial_refs_{case}" in fig:
            out[f"refs_{case}"] = _text(model, fig[f"spatial_refs_{case}"]["greedy_ids"])
    return out


def answered(model, image: Path, want: dict, settings: dict) -> dict:
    """The same entries as `want`, asked through the public API with the recorded settings."""
    text = {"max_tokens": settings["greedy"]["max_tokens"]}
    regions = {"max_objects": settings["greedy"]["max_objects"]}
    question, thinking = settings["question"]["text"], settings["reasoning_question"]["text"]
    thing, eyes, refs = settings["object"]["text"], settings["eyes"], settings["spatial_refs_cases"]
    calls = {
        "caption_short": lambda: model.caption(image, length="short", settings=text)["caption"],
        "caption_normal": lambda: model.caption(image, length="normal", settings=text)["caption"],
        "query": lambda: model.query(image, question, settings=text)["answer"],
        "reasoning": lambda: dict(model.query(image, thinking, reasoning=True, settings=text)),
        "detect": lambda: _unscored(model.detect(image, thing, settings=regions)["objects"]),
        "point": lambda: _unscored(model.point(image, thing, settings=regions)["points"]),
        **{f"gaze_{k}": (lambda e=tuple(eye): model.detect_gaze(image, eye=e)["gaze"]) for k, eye in enumerate(eyes)},
        **{f"refs_{case}": (lambda r=r: model.query(image, thinking, spatial_refs=r, settings=text)["answer"])
           for case, r in refs.items()},
    }
    return {call: calls[call]() for call in want}


def skills_folder(fixture: Path, into: Path) -> Path:
    """The fixture with its skills weights: lm_head replaced by skills_lm_head.safetensors."""
    from safetensors.torch import load_file, save_file

    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_bytes((fixture / "config.json").read_bytes())
    (into / "tokenizer.json").write_bytes((fixture / "tokenizer.json").read_bytes())
    state = load_file(fixture / "model.safetensors")
    state.update(load_file(fixture / "skills_lm_head.safetensors"))
    save_file(state, into / "model.safetensors", metadata={"format": "pt"})
    return into


def all_at_once(jobs: dict) -> dict:
    """Every job from its own thread at once (their calls share the engine's batches): key -> result."""
    out: dict = {}
    threads = [threading.Thread(target=lambda k=k, job=job: out.__setitem__(k, job())) for k, job in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def mode_failures(folders: dict, fixture: Path, device: str, pipelined: bool) -> tuple[list, int]:
    """(failures, calls made) of every recorded result, alone and then all images at once, in one mode."""
    settings = figures(fixture)["settings"]
    models = {w: foveal.load(folder, device=device, dtype="float32", pipelined=pipelined)
              for w, (folder, _) in folders.items()}
    try:
        wanted = {(w, name): expected(models[w], fig, settings)
                  for w, (_, which) in folders.items() for name, fig in figures(fixture, which)["images"].items()}
        jobs = {key: (lambda k=key: answered(models[k[0]], fixture / "images" / f"{k[1]}.png", wanted[k], settings))
                for key in wanted}
        alone = {key: job() for key, job in jobs.items()}
        shared = all_at_once(jobs)
    finally:
        for model in models.values():
            model.close()
    failures = [(*key, call, pipelined, how, got.get(key, {}).get(call))
                for how, got in (("alone", alone), ("shared", shared))
                for key, want in wanted.items() for call in want if got.get(key, {}).get(call) != want[call]]
    return failures, 2 * sum(len(w) for w in wanted.values())


def api_results(fixture: Path, device: str, weight_sets: tuple[str, ...]) -> dict:
    """Every recorded result through foveal.load, pipelined and blocking."""
    failures: list = []
    calls = 0
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"base": (fixture, "figures")}
        if "skills" in weight_sets:
            folders["skills"] = (skills_folder(fixture, Path(tmp) / "skills"), "figures_skills")
        for pipelined in (True, False):
            more, n = mode_failures(folders, fixture, device, pipelined)
            failures += more
            calls += n
    return {"ok": not failures, "calls": calls, "weights": list(folders), "failures": failures[:10]}


def no_host_sync(runner, device: str) -> dict:
    """Decode launches (3 rows: the gathered MoE path; 6 rows: dense, at the tiny config's 8 experts top 2)
    with token, coordinate and size rows, then the region sampler, with host syncs made errors on CUDA
    (on CPU the same launches run, which checks the script, not the syncs)."""
    cuda, v = device == "cuda", runner.vocab_size
    errors, sizes_sampled = [], True
    for rows in (3, 6):
        items = [([(1, v + 3, v + 2000)[i % 3]], 5, [i], None) for i in range(rows)]  # token, coordinate, size ids
        batch = parity.make_batch(items, PAGE, device)
        kinds = torch.tensor([(0, GATE, SIZE)[i % 3] for i in range(rows)], device=device)
        region_rows = torch.tensor([i for i in range(rows) if i % 3], device=device)
        sampled = torch.zeros(rows, dtype=torch.int64, device=device)
        runner.forward(batch)  # warm: first-call allocations are not the step's
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            logits = runner.forward(batch)
            sampled.copy_(logits.argmax(dim=-1))
            runner.sample_regions(runner.last_hidden, kinds, region_rows, sampled)
        except RuntimeError as exc:
            errors.append(f"{rows} rows: {exc}")
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        sizes_sampled &= bool((sampled[2::3] >= v).all())  # a SIZE row's id became a size value's
    runner.quiesce()  # CPU: the launches started background traces; none may run into the timings
    return {"ok": not errors and sizes_sampled, "errors": errors, "size_rows_sampled_sizes": sizes_sampled,
            "sync_debug": cuda}


def check_parity(fixture: Path, device: str, quick: bool) -> dict:
    exact_float32()
    # The runner-level checks drive a family without an engine (families.load is what foveal.load
    # loads before starting one), so their KV pool is their own.
    family = families.load(fixture, device=device, dtype="float32")
    return {
        "prefill_logits": prefill_logits(family, fixture),
        "no_host_sync": no_host_sync(family.runner, device),
        "api_results": api_results(fixture, device, ("base",) if quick else ("base", "skills")),
    }


# ---- 2. mixture of experts ---------------------------------------------------------------------------------


def moe_configs() -> dict[str, tuple[int, MoeConfig, int]]:
    """name -> (dim, MoeConfig, MoE layers per decode step)."""
    tiny = MoondreamConfig.from_dict(MOE_DECODE_CONFIGS["tiny"], 3).text
    real = MoondreamConfig.from_dict({}, 3).text  # an empty config entry is the real model
    return {name: (t.dim, t.moe, t.n_layers - t.moe.start_layer) for name, t in (("tiny", tiny), ("real", real))}


def moe_layer(dim: int, cfg: MoeConfig, device: str) -> MoE:
    torch.manual_seed(0)
    moe = MoE(dim, cfg, device=device, dtype=torch.float32)
    for p in moe.parameters():  # moe_decode's draw: unit-scale activations through every matmul
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return moe.eval().requires_grad_(False)


def _path(moe: MoE, name: str, h: torch.Tensor) -> torch.Tensor:
    if name == "forward":
        return moe(h, True)  # decode=True: the runner's own choice for this many rows
    return getattr(moe, name)(h, *moe.route(h))


def moe_agreement(moe: MoE, rows: tuple[int, ...], dtype: torch.dtype) -> dict[str, float]:
    """Per path, the worst over `rows` of max |path - looped| / max |looped| on one routing."""
    paths = [p for p in MOE_PATHS if p != "looped"]
    probe = torch.zeros(1, moe.router.in_features, device=moe.router.weight.device, dtype=dtype)
    worst = {p: 0.0 for p in paths if p != "grouped_mm" or grouped_mm_runs(probe)}  # torch's kernel: bf16 on CUDA
    for n in rows:
        h = torch.randn(n, moe.router.in_features, device=moe.router.weight.device, dtype=dtype)
        experts, weights = moe.route(h)
        ref = moe.looped(h, experts, weights).float()
        for p in worst:  # one routing for all; forward routes again, to the same experts
            got = moe(h, True) if p == "forward" else getattr(moe, p)(h, experts, weights)
            worst[p] = max(worst[p], float((got.float() - ref).abs().max() / ref.abs().max()))
    return worst


def moe_timing(moe: MoE, rows: int, steps: int, device: str) -> dict[str, float]:
    """Median ms of one MoE layer's decode step (routing included) per path, paths interleaved step by step."""
    h = torch.randn(rows, moe.router.in_features, device=device, dtype=moe.router.weight.dtype)
    times: dict[str, list[float]] = {p: [] for p in MOE_PATHS if p != "grouped_mm" or grouped_mm_runs(h)}
    for step in range(steps + 3):  # 3 warm-up steps
        for p in times:
            _sync(device)
            start = time.perf_counter()
            _path(moe, p, h)
            _sync(device)
            if step >= 3:
                times[p].append((time.perf_counter() - start) * 1e3)
    return {p: statistics.median(t) for p, t in times.items()}


def check_moe(device: str, configs: list[str], rows: tuple[int, ...], steps: int) -> dict:
    out: dict = {"tolerance": MOE_TOLERANCE, "agreement": [], "timing": []}
    with torch.inference_mode():
        for name, (dim, cfg, layers) in moe_configs().items():
            if name not in configs:
                continue
            moe = moe_layer(dim, cfg, device)
            for dtype in (torch.float32, torch.bfloat16):
                moe = moe.to(dtype)  # float32 first: the bf16 weights are the float32 draw rounded
                worst = moe_agreement(moe, rows, dtype)
                tol = MOE_TOLERANCE[str(dtype).removeprefix("torch.")]
                out["agreement"].append({"config": name, "dtype": str(dtype), "worst_relative": worst,
                                         "ok": all(d <= tol for d in worst.values())})
            for n in rows:  # moe is bfloat16 now
                ms = moe_timing(moe, n, steps, device)
                # looped is the reference, not a candidate: it syncs with the host (nonzero) and cannot trace
                fastest = min((p for p in CANDIDATES if p in ms), key=ms.__getitem__)
                out["timing"].append({"config": name, "dim": dim, "experts": cfg.num_experts,
                                      "top_k": cfg.experts_per_token, "inner": cfg.expert_inner_dim,
                                      "moe_layers": layers, "rows": n, "ms": ms, "fastest": fastest,
                                      "step_ms_forward": ms["forward"] * layers})
            del moe
            if device == "cuda":
                torch.cuda.empty_cache()
    out["ok"] = all(a["ok"] for a in out["agreement"])
    return out


# ---- 3. end to end -----------------------------------------------------------------------------------------


def check_e2e(fixture: Path, device: str, batches: tuple[int, ...], max_tokens: int, reps: int) -> dict:
    """Captions of `batch` distinct random images (new ones each round, so no prefix-cache hits), bf16."""
    rng = np.random.default_rng(0)
    rows = []
    for pipelined in (True, False):
        with foveal.load(fixture, device=device, dtype="bfloat16", pipelined=pipelined,
                         max_batch_size=max(batches)) as model:
            for batch in batches:
                runs = []
                for rep in range(reps + 1):  # the first round warms kernels (and, on CPU, traces)
                    images = [rng.integers(0, 256, (378, 378, 3), dtype=np.uint8) for _ in range(batch)]
                    _sync(device)
                    start = time.perf_counter()
                    results = model.caption(images, settings={"max_tokens": max_tokens})
                    seconds = time.perf_counter() - start
                    if rep:
                        runs.append((seconds, [r.usage for r in results]))
                seconds, usages = sorted(runs, key=lambda r: r[0])[len(runs) // 2]  # the median round
                tokens = sum(u.completion_tokens for u in usages)
                rows.append({"pipelined": pipelined, "batch": batch, "seconds": seconds, "tokens": tokens,
                             "tok_s": tokens / seconds,
                             "prefill_ms": statistics.median(u.prefill_time_ms for u in usages),
                             "decode_tok_s_per_call": statistics.median(
                                 (u.completion_tokens - 1) / max(u.decode_time_ms, 1e-6) * 1e3 for u in usages)})
    for row in rows:
        if row["pipelined"]:
            blocking = next(r for r in rows if not r["pipelined"] and r["batch"] == row["batch"])
            row["gain"] = row["tok_s"] / blocking["tok_s"]
    return {"ok": True, "dtype": "bfloat16", "max_tokens": max_tokens, "rows": rows}


# ---- report ------------------------------------------------------------------------------------------------


def machine(device: str) -> dict:
    from benchmarks.run import cpu_model

    out = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
           "cpu": cpu_model(), "torch_threads": torch.get_num_threads()}
    if device == "cuda":
        out |= {"name": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    return out


def print_report(report: dict) -> None:
    m = report["machine"]
    print(f"device {m.get('name', m['cpu'])} ({m['device']}), torch {m['torch']}")
    for name, row in report.get("parity", {}).items():
        detail = {k: v for k, v in row.items() if k != "ok"}
        print(f"{'PASS' if row['ok'] else 'FAIL'} parity.{name} {detail}")
    moe = report.get("moe")
    if moe:
        for row in moe["agreement"]:
            worst = " ".join(f"{p} {d:.1e}" for p, d in row["worst_relative"].items())
            tol = MOE_TOLERANCE[row["dtype"].removeprefix("torch.")]
            print(f"{'PASS' if row['ok'] else 'FAIL'} moe.agreement {row['config']} {row['dtype']}: {worst} (<= {tol})")
        print("median ms of one MoE layer per decode step, bfloat16 (step = forward x MoE layers)")
        print(f"{'config':6s} {'rows':>4s} " + " ".join(f"{p:>9s}" for p in MOE_PATHS) + f" {'fastest':>9s} {'step':>8s}")
        for row in moe["timing"]:
            ms = " ".join(f"{row['ms'][p]:9.3f}" if p in row["ms"] else f"{'-':>9s}" for p in MOE_PATHS)
            print(f"{row['config']:6s} {row['rows']:4d} {ms} {row['fastest']:>9s} {row['step_ms_forward']:8.2f}")
    e2e = report.get("e2e")
    if e2e:
        print(f"tiny model end to end, {e2e['dtype']}, captions of max_tokens {e2e['max_tokens']} on distinct images")
        print(f"{'mode':9s} {'batch':>5s} {'tok/s':>8s} {'prefill ms':>10s} {'tok/s/call':>10s} {'gain':>6s}")
        for row in e2e["rows"]:
            mode = "pipelined" if row["pipelined"] else "blocking"
            gain = f"{row['gain']:6.2f}" if "gain" in row else ""
            print(f"{mode:9s} {row['batch']:5d} {row['tok_s']:8.1f} {row['prefill_ms']:10.1f} "
                  f"{row['decode_tok_s_per_call']:10.1f} {gain}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda")
    parser.add_argument("--fixture", type=Path, default=FIXTURE)
    parser.add_argument("--out", default=os.environ.get("OUT") or "out/benchmarks")
    parser.add_argument("--sections", nargs="+", choices=["parity", "moe", "e2e"], default=["parity", "moe", "e2e"])
    parser.add_argument("--quick", action="store_true",
                        help="base weights only, MoE at the tiny config and 1 and 4 rows, short e2e (smoke run)")
    parser.add_argument("--real-moe", action="store_true", help="time the real-size MoE on CPU too (GBs, slow)")
    parser.add_argument("--moe-rows", help="the MoE section's decode rows, e.g. 1,4,16 (default 1,4,16,64; --quick 1,4)")
    parser.add_argument("--moe-steps", type=int, help="timed steps per MoE path and row count (default 30; --quick 5)")
    args = parser.parse_args(argv)
    device = args.device or "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch; run on a CUDA machine, or pass --device cpu for a dry run")
        return 2
    needs_fixture = {"parity", "e2e"} & set(args.sections)
    if needs_fixture and not (args.fixture / "figures.json").is_file():
        print(f"the moondream3-tiny fixture is not at {args.fixture}; pass --fixture, or --sections moe")
        return 2
    real = device == "cuda" or args.real_moe
    moe_rows = tuple(int(n) for n in args.moe_rows.split(",")) if args.moe_rows else ((1, 4) if args.quick else (1, 4, 16, 64))
    began = time.perf_counter()
    report: dict[str, Any] = {"machine": machine(device), "fixture": str(args.fixture), "quick": args.quick}
    sections = {
        "parity": lambda: check_parity(args.fixture, device, args.quick),
        "moe": lambda: check_moe(device, ["tiny"] + (["real"] if real and not args.quick else []), moe_rows,
                                 steps=args.moe_steps or (5 if args.quick else 30)),
        "e2e": lambda: check_e2e(args.fixture, device, (1, 4) if args.quick else (1, 16),
                                 8 if args.quick else 64, 1 if args.quick else 3),
    }
    report["section_seconds"] = {}
    for name in args.sections:
        start = time.perf_counter()
        report[name] = sections[name]()
        report["section_seconds"][name] = round(time.perf_counter() - start, 1)
    report["seconds"] = time.perf_counter() - began
    ok = all(row["ok"] for row in report.get("parity", {}).values()) and report.get("moe", {}).get("ok", True)
    report["ok"] = ok
    print_report(report)
    took = ", ".join(f"{k} {v:.0f} s" for k, v in report["section_seconds"].items())
    print(f"wrote {write_json(Path(args.out) / 'device_check_moondream3.json', report)} in {report['seconds']:.0f} s ({took})")
    if device == "cuda" and report["seconds"] > LIMIT_S:
        print(f"OVER THE LIMIT: {report['seconds']:.0f} s > {LIMIT_S} s; shrink the sizes in this script")
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
