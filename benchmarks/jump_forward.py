"""Jump-forward decoding on vs off: latency of one JSON call, throughput of 32, and what changes in the answers.

    python -m benchmarks.jump_forward [--quick] [--calls 8] [--requests 32] [--out out/benchmarks/jump_forward.json]

SmolLM2-135M-Instruct (real weights, `smollm2_folder()`; `--quick`: a tiny random Llama with its
tokenizer) is loaded twice through `foveal.load`, `jump_forward=True` and `False`, and both engines
get the same requests of `benchmarks.peers`' two workloads (json: a person schema; detect: the
detect skill's box shape), greedy, the same prompt ids, the same compiled automaton:
  - latency: `--calls` requests one at a time, the two models alternating call by call, so that
    the machine's load falls on both alike; median milliseconds per call;
  - throughput: `--requests` requests submitted at once, the two models in turn.
Reported beside the speed: every output's validity, how many answers have the same text and the
same token ids with and without jump-forward, engine steps, and the tokens jump-forward appended
without a step of their own. Token ids may differ where the grammar's canonical tokenization of a
forced run differs from what the model would have sampled; the text then usually stays the same.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import foveal
from benchmarks import peers, write_json
from foveal import grammars
from foveal.engine import Request, SamplingParams
from foveal.testing.smollm2 import smollm2_folder


def requests(model: foveal.Model, workload: peers.Workload) -> list[Request]:
    automaton = grammars.compile(workload.foveal_type, model.family.tokenizer)
    sampling = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens)
    return [Request(ids, sampling, automaton.matcher()) for ids in peers.prompt_ids(model, workload)]


def latency(models: dict[str, foveal.Model], workload: peers.Workload, calls: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in models}
    outputs: dict[str, list] = {name: [] for name in models}
    for i in range(calls):
        for name, model in models.items():
            request = requests(model, workload)[i % len(workload.asks)]
            started = time.perf_counter()
            outputs[name] += model.engine.generate([request], timeout=600)
            times[name].append(time.perf_counter() - started)
    return {name: {"median_ms": 1e3 * statistics.median(t), "outputs": outputs[name]} for name, t in times.items()}


def throughput(model: foveal.Model, workload: peers.Workload) -> dict[str, Any]:
    batch = requests(model, workload)
    model.engine.reset_stats()
    started = time.perf_counter()
    outputs = model.engine.generate(batch, timeout=1200)
    wall = time.perf_counter() - started
    stats = model.engine.stats()
    return {
        "wall_s": wall,
        "requests_per_s": len(batch) / wall,
        "steps": stats["steps"],
        "jumps": stats["jumps"],
        "forced_tokens": stats["forced_tokens"],
        "tokens": stats["tokens"],
        "outputs": outputs,
    }


def compare(on: list, off: list, workload: peers.Workload) -> dict[str, Any]:
    return {
        "valid_on": sum(peers.is_valid(workload, o.text) for o in on),
        "valid_off": sum(peers.is_valid(workload, o.text) for o in off),
        "same_text": sum(a.text == b.text for a, b in zip(on, off, strict=True)),
        "same_tokens": sum(a.token_ids == b.token_ids for a, b in zip(on, off, strict=True)),
        "answers": len(on),
    }


def run(folder: Path, calls: int, n: int) -> dict[str, Any]:
    models = {
        name: foveal.load(folder, device="cpu", max_batch_size=n, max_model_len=peers.MAX_MODEL_LEN, jump_forward=jump)
        for name, jump in (("on", True), ("off", False))
    }
    report: dict[str, Any] = {}
    try:
        for workload in (peers.json_workload(n), peers.detect_workload(n)):
            for model in models.values():  # warm: traces, compiled grammar, allocator
                model.engine.generate(requests(model, workload)[:2], timeout=600)
            single = latency(models, workload, calls)
            batch = {name: throughput(model, workload) for name, model in models.items()}
            report[workload.name] = {
                "latency_ms": {name: row["median_ms"] for name, row in single.items()},
                "latency_answers": compare(single["on"]["outputs"], single["off"]["outputs"], workload),
                "batch": {name: {k: v for k, v in row.items() if k != "outputs"} for name, row in batch.items()},
                "batch_answers": compare(batch["on"]["outputs"], batch["off"]["outputs"], workload),
            }
    finally:
        for model in models.values():
            model.close()
    return report


def print_table(report: dict[str, Any], calls: int, n: int) -> None:
    print(f"{'workload':9} {'mode':4} {'1 call ms':>10} {f'{n} req/s':>9} {'steps':>6} {'forced':>7} "
          f"{'valid':>7} {'same text':>10} {'same ids':>9}")
    for name, row in report.items():
        for mode in ("on", "off"):
            batch, answers = row["batch"][mode], row["batch_answers"]
            print(
                f"{name:9} {mode:4} {row['latency_ms'][mode]:10.0f} {batch['requests_per_s']:9.2f} "
                f"{batch['steps']:6d} {batch['forced_tokens']:7d} {answers[f'valid_{mode}']:>3}/{answers['answers']:<3} "
                f"{answers['same_text']:>6}/{answers['answers']:<3} {answers['same_tokens']:>5}/{answers['answers']:<3}"
            )
        lat = row["latency_ms"]["off"] / row["latency_ms"]["on"]
        thr = row["batch"]["on"]["requests_per_s"] / row["batch"]["off"]["requests_per_s"]
        print(f"{name:9} jump-forward speed-up: one call {lat:.2f}x, {n} requests {thr:.2f}x "
              f"(latency answers: {row['latency_answers']['same_text']}/{calls} same text)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama: a smoke run, not a measurement")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--out", default="out/benchmarks/jump_forward.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = peers.tiny_llama_folder(tmp) if args.quick else smollm2_folder()
        report = run(folder, args.calls, args.requests)
    print(f"jump-forward on vs off, {'tiny Llama (--quick)' if args.quick else 'SmolLM2-135M-Instruct'}, greedy, CPU")
    print_table(report, args.calls, args.requests)
    path = write_json(args.out, {"args": vars(args), "workloads": report})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
