"""Device check for foveal.engine on a CUDA machine (a CPU twin of each check runs in tests/engine).

    python -m benchmarks.device_check_engine [--out out/device_check_engine.json] [--cpu]

Checks, each printed PASS/FAIL, and a JSON report:
  1. streams: the engine uses a compute stream and a copy stream (not the default stream), pinned
     host buffers, and its host copy of sampled ids is asynchronous (launch returns before the GPU
     finishes: host time per launch << the forward's GPU time);
  2. correctness: pipelined == blocking, token for token, for greedy, seeded top-p and
     grammar-constrained requests, with the fake runner on the GPU and with a tiny random Llama
     (`foveal.engine.models`, if importable) on the GPU;
  3. performance: fake runner with a 1 ms and a 5 ms GPU forward (a calibrated spin kernel),
     8 and 64 streams, blocking vs pipelined: gain, ideal gain (F+S+B)/(F+S) and GPU idle
     fraction (from CUDA events).
`--cpu` runs the same script on the CPU device (a smoke test of the script itself).
Sized to finish in about 2 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import write_json
from foveal import grammars
from foveal.engine import Engine, EngineConfig, Request, SamplingParams
from foveal.testing import FakeRunner

from .pipeline import EOS, PATTERN, VOCAB, make_tokenizer, save_tiny_llama

RESULTS: dict = {"checks": {}, "perf": []}


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def config(pipelined: bool, streams: int = 16, **kw) -> EngineConfig:
    base = dict(
        pipelined=pipelined,
        max_batch=streams,
        eos_token_ids=(EOS,),
        page_size=16,
        num_pages=2048,
        max_model_len=512,
    )
    base.update(kw)
    return EngineConfig(**base)


def check_streams(device: str, tokenizer) -> None:
    runner = FakeRunner(vocab_size=VOCAB, delay_s=0.005, device=device)
    with Engine(runner, tokenizer, config(True)) as engine:
        dev = engine.device
        if device == "cuda":
            default = torch.cuda.default_stream()
            check(
                "streams.separate", dev.compute != default and dev.copy != default and dev.compute != dev.copy
            )
            check(
                "streams.pinned_host_buffers",
                all(s.sampled_host.is_pinned() and s.host.input_ids.is_pinned() for s in engine.slots),
            )
        engine.generate([Request([1, 2], SamplingParams(max_tokens=4, ignore_eos=True))])
        engine.reset_stats()
        engine.generate([Request([1, 2], SamplingParams(max_tokens=40, ignore_eos=True))])
        s = engine.stats()
    launch_ms = s["phase_ms_per_step"]["launch"]
    check(
        "streams.async_launch",
        launch_ms < 0.5 * s["forward_ms"],
        f"launch {launch_ms:.3f} ms vs forward {s['forward_ms']:.3f} ms",
    )


def outputs(runner_factory, tokenizer, requests_factory, pipelined: bool, fill_masks=None) -> list:
    kw = {"fill_masks": fill_masks} if fill_masks else {}
    with Engine(runner_factory(), tokenizer, config(pipelined, **kw)) as engine:
        outs = engine.generate(requests_factory(), timeout=300)
        idle_ok = engine.wait_idle(10) and engine.free_pages() == engine.config.num_pages
    return [(o.token_ids, o.finish_reason.value) for o in outs], idle_ok


def check_equality(device: str, tokenizer, automaton) -> None:
    def requests():
        return [
            Request(
                [1 + (i * 5 + j) % 300 for j in range(1 + i % 9)],
                SamplingParams(max_tokens=8 + i % 40, temperature=[0.0, 1.0][i % 2], top_p=0.9, seed=i),
                automaton.matcher() if i % 3 == 0 else None,
            )
            for i in range(96)
        ]

    def fake() -> FakeRunner:
        return FakeRunner(vocab_size=VOCAB, delay_s=0.0005, jitter_s=0.001, boost={EOS: 2.0}, device=device)

    a, ok_a = outputs(fake, tokenizer, requests, True, grammars.fill_masks)
    b, ok_b = outputs(fake, tokenizer, requests, False, grammars.fill_masks)
    check(
        "equality.fake_runner",
        a == b and ok_a and ok_b,
        f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)} equal",
    )
    try:
        from foveal.engine import models  # noqa: F401
    except ImportError as e:
        check("equality.llama", False, f"foveal.engine.models not importable: {e}")
        return
    check_llama(device)


def check_llama(device: str) -> None:
    import tempfile

    import transformers as tf

    from foveal import families

    tokenizer = make_tokenizer()
    with tempfile.TemporaryDirectory() as folder:
        save_tiny_llama(tokenizer, folder)
        loaded = families.load(folder, device=device, dtype=torch.float32)
        reference = tf.LlamaForCausalLM.from_pretrained(folder).to(device).eval()
    prompts = [
        tokenizer.encode(p, add_special_tokens=False).ids
        for p in ["the quick brown", "a red circle left of", "a"]
    ]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids], device=device), max_new_tokens=12, do_sample=False)
        expected.append([t for t in out[0, len(ids) :].tolist() if t != EOS])

    def requests():
        return [Request(ids, SamplingParams(max_tokens=12)) for ids in prompts]

    a, _ = outputs(lambda: loaded.runner, loaded.tokenizer, requests, True)
    b, _ = outputs(lambda: loaded.runner, loaded.tokenizer, requests, False)
    check("equality.llama_pipelined_blocking", a == b)
    check(
        "equality.llama_vs_generate",
        [t for t, _ in a] == expected,
        f"{[t for t, _ in a][:1]} vs {expected[:1]}",
    )


def perf(device: str, tokenizer, automaton) -> None:
    from .pipeline import run

    print(
        f"{'F':>4} {'streams':>7} {'grammar':>7} | {'F ms':>6} {'S ms':>6} {'B ms':>6} | {'gain':>5} {'ideal':>5} | {'idle blk':>8} {'idle pipe':>9}"
    )
    for forward_s in (0.001, 0.005):
        for streams in (8, 64):
            for constrained in (False, True):
                aut = automaton if constrained else None
                blk = run(tokenizer, aut, forward_s, streams, False, 64, device=device)
                pipe = run(tokenizer, aut, forward_s, streams, True, 64, device=device)
                f, s, b = blk["forward_ms"], blk["sample_ms"], blk["host_ms_per_step"]
                row = {
                    "forward_target_ms": forward_s * 1e3,
                    "streams": streams,
                    "constrained": constrained,
                    "F_ms": f,
                    "S_ms": s,
                    "B_ms": b,
                    "ideal_gain": (f + s + b) / (f + s),
                    "gain": pipe["tokens_per_s"] / blk["tokens_per_s"],
                    "blocking_idle": 1 - blk["device_busy_fraction"],
                    "pipelined_idle": 1 - pipe["device_busy_fraction"],
                }
                RESULTS["perf"].append(row)
                print(
                    f"{forward_s * 1e3:>3.0f}m {streams:>7} {'yes' if constrained else 'no':>7} | {f:>6.2f} {s:>6.2f} {b:>6.2f} | "
                    f"{row['gain']:>5.2f} {row['ideal_gain']:>5.2f} | {row['blocking_idle']:>8.1%} {row['pipelined_idle']:>9.1%}",
                    flush=True,
                )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="out/device_check_engine.json")
    parser.add_argument(
        "--cpu", action="store_true", help="run on the CPU device (smoke test of this script)"
    )
    parser.add_argument("--skip-perf", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu for a smoke run", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    RESULTS["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    tokenizer = make_tokenizer()
    automaton = grammars.compile(grammars.Regex(PATTERN), tokenizer, eos_token_id=EOS, vocab_size=VOCAB)
    check_streams(device, tokenizer)
    check_equality(device, tokenizer, automaton)
    if not args.skip_perf:
        perf(device, tokenizer, automaton)
    RESULTS["seconds"] = time.perf_counter() - t0
    out = write_json(args.out, RESULTS)
    failed = [k for k, v in RESULTS["checks"].items() if not v["ok"]]
    print(
        f"{len(RESULTS['checks']) - len(failed)}/{len(RESULTS['checks'])} checks passed in {RESULTS['seconds']:.0f} s; wrote {out}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
