"""Less work per answer (issue 18): foveal's prefix cache and jump-forward against transformers + outlines, one table.

    python -m benchmarks.less_work [--quick] [--out out/benchmarks/less_work.json]

Four workloads, every contender warm (each first runs its workload once untimed), greedy, the same
prompt token ids (the chat template foveal's skills build), validity of every output beside its speed:
  1. shared prefix: 32 concurrent JSON extraction questions over one ~600-token document, SmolLM2
     (real weights). foveal from 32 threads (prefix cache and jump-forward on, the defaults) vs
     transformers `generate` on the 32 prompts (left-padded) with outlines' logits processor.
  2. one image, many objects: 8 detect calls per image on 4 images, on a VLM with 256 image tokens:
     LLaVA's architecture around SmolLM2's real text weights, with a small random CLIP tower
     (224 px, patch 14) and projector (`vlm_folder`; no VLM checkpoint can be downloaded here, so the
     answers are arbitrary, but every token costs what a real one does). foveal `model.detect` from
     32 threads with the prefix cache on vs off (the image feature cache off in both, so only the
     prefix cache can skip the vision encoder), vs transformers `generate` on the 32 prompts with
     their pixels and outlines' processor for the detect shape.
  3. one JSON-schema call at batch 1 (latency, median of `--calls`): foveal with jump-forward on vs
     off, vs transformers + outlines on the same prompt.
  4. the existing 32-request workloads of `benchmarks.peers` (json, detect), constrained: foveal vs
     transformers + outlines.
Targets (issue 18): 1: >= 3x; 2: on/off >= 2x and >= 3x the peer; 3: >= 2x the peer; 4: >= 1.5x.
`--quick`: tiny random models, few requests (a smoke run of the harness, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import torch
import transformers

import foveal
from benchmarks import peers, prefix_cache, write_json
from foveal.testing import tiny
from foveal.testing.smollm2 import smollm2_folder

FACTS_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 40},
        "found_in_document": {"type": "boolean"},
    },
    "required": ["answer", "found_in_document"],
    "additionalProperties": False,
}
QUESTIONS = [
    "Which town is described?", "When was the lighthouse rebuilt?", "Which island does the ferry reach?",
    "On which day is there no ferry?", "Which fish are sold?", "What do farmers bring?",
    "When does the market open?", "What broke the lamp room?",
]
TARGETS = {"shared prefix": 3.0, "image objects (cache on/off)": 2.0, "image objects": 3.0,
           "json latency": 2.0, "json": 1.5, "detect": 1.5}


def valid_facts(text: Any) -> bool:
    try:
        jsonschema.validate(json.loads(text), FACTS_SCHEMA)
    except (TypeError, ValueError, jsonschema.ValidationError):
        return False
    return True


# ---- contenders ------------------------------------------------------------------------------------------


def foveal_threads(calls: list, valid) -> dict[str, Any]:
    """Every call from its own thread at once; calls are zero-argument functions returning text or a result."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(calls)) as pool:
        outputs = list(pool.map(_guarded, calls))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "req_s": len(calls) / wall, "valid": sum(valid(o) for o in outputs), "n": len(calls)}


def _guarded(call) -> Any:
    try:
        return call()
    except (foveal.IncompleteOutputError, foveal.GenerationError) as error:
        return error


def peer(hf: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, output_type: Any, valid,
         images: torch.Tensor | None = None) -> dict[str, Any]:
    """transformers `generate` on one left-padded batch with outlines' logits processor."""
    processor = peers.outlines_processor(hf, tokenizer, output_type)
    texts, _, wall, _ = peers.hf_generate(hf, tokenizer, prompts, max_tokens, processor, images)
    return {"wall_s": wall, "req_s": len(prompts) / wall, "valid": sum(valid(t) for t in texts), "n": len(prompts)}


def warm_and_time(run) -> dict[str, Any]:
    run()
    return run()


# ---- 1. shared prefix ------------------------------------------------------------------------------------


def shared_prefix(model: foveal.Model, hf: Any, n: int, doc_tokens: int) -> list[dict]:
    doc = prefix_cache.document(model.family.tokenizer, doc_tokens)
    asks = [f"{doc}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]} (#{i}) Answer in JSON." for i in range(n)]
    settings = {"temperature": 0.0, "max_tokens": 48}
    calls = [lambda a=a: model.generate(None, a, FACTS_SCHEMA, settings)["text"] for a in asks]
    ours = warm_and_time(lambda: foveal_threads(calls, valid_facts))
    prompts = [model.family.encode(model.family.query(a), [], None)[0].token_ids for a in asks]
    theirs = warm_and_time(lambda: peer(hf, model.family.tokenizer, prompts, 48, FACTS_SCHEMA, valid_facts))
    return [row("shared prefix", "foveal", ours), row("shared prefix", "transformers + outlines", theirs)]


# ---- 2. one image, many objects --------------------------------------------------------------------------


def vlm_folder(folder: Path, text_source: Path | None) -> Path:
    """LLaVA around SmolLM2's text model (`text_source`; None: tiny.TEXT random) with a small random CLIP
    tower of 224 px / patch 14 (256 image tokens) and projector, saved with its processor."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    torch.manual_seed(0)
    if text_source is None:
        tok = tiny.train_tokenizer()
        text_config = transformers.LlamaConfig(vocab_size=len(tok), **{**tiny.TEXT, "max_position_embeddings": 1024})
        text = transformers.LlamaForCausalLM(text_config)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(text_source)
        tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
        text = transformers.AutoModelForCausalLM.from_pretrained(text_source, dtype=torch.float32)
        text.resize_token_embeddings(len(tok))
        text_config = text.config
    vision = transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=224, patch_size=14)
    config = transformers.LlavaConfig(
        vision_config=vision.to_dict(), text_config=text_config.to_dict(),
        image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1, architectures=["LlavaForConditionalGeneration"],
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = transformers.LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1)
    if tok.chat_template:
        processor.chat_template = tok.chat_template
    return tiny.save(model, folder, processor=processor)


def image_objects(folder: Path, n_images: int, per_image: int, device: str = "cpu") -> list[dict]:
    images = tiny.images(n_images)
    phrases = [peers.PHRASES[i % len(peers.PHRASES)] for i in range(per_image)]
    settings = {"temperature": 0.0, "max_tokens": 96, "max_objects": peers.MAX_OBJECTS}
    rows = []
    for cache in (True, False):
        with foveal.load(folder, device=device, max_batch_size=n_images * per_image, image_cache_bytes=0,
                         prefix_cache=cache) as model:
            calls = [lambda im=im, p=p: model.detect(im, p, settings=settings) for im in images for p in phrases]
            result = warm_and_time(lambda calls=calls: foveal_threads(calls, peers.valid_detect))
            result["cached_prompt_share"] = model.engine.stats()["prefix_hit_rate"]
            rows.append(row("image objects", f"foveal, prefix cache {'on' if cache else 'off'}", result))
            if cache:
                prompts, pixels = vlm_prompts(model, images, phrases)
                tokenizer = model.family.tokenizer
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    theirs = warm_and_time(lambda: peer(hf, tokenizer, prompts, 96, peers.Detection, peers.valid_detect, pixels))
    rows.append(row("image objects", "transformers + outlines", theirs))
    return rows


def vlm_prompts(model: foveal.Model, images: list, phrases: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    """The prompt ids and pixels foveal's detect skill builds, for the peer (same text, same image inputs)."""
    task = lambda p: model.family.detect(p, peers.MAX_OBJECTS)  # noqa: E731
    inputs = [model.family.encode(task(p), [im], None)[0] for im in images for p in phrases]
    pixels = torch.cat([i.prefill.image_tensors["pixel_values"] for i in inputs])
    return [i.token_ids for i in inputs], pixels


# ---- 3. one JSON call ------------------------------------------------------------------------------------


def json_latency(source: Path, hf: Any, calls: int, device: str = "cpu") -> list[dict]:
    """Median latency of one call; the two foveal models alternate call by call, so that the machine's
    load falls on both alike (on a shared machine a sequential A then B compares two loads)."""
    ask = peers.json_workload(1).asks[0]
    settings = {"temperature": 0.0, "max_tokens": 64}
    models = {
        jump: foveal.load(source, device=device, max_batch_size=4, max_model_len=peers.MAX_MODEL_LEN, jump_forward=jump)
        for jump in (True, False)
    }
    try:
        results = median_calls(
            {jump: (lambda m=m: m.generate(None, ask, peers.PERSON_SCHEMA, settings)["text"]) for jump, m in models.items()},
            calls,
        )
        model = models[True]
        prompt = [model.family.encode(model.family.query(ask), [], None)[0].token_ids]
        tokenizer = model.family.tokenizer
    finally:
        for model in models.values():
            model.close()
    processor = peers.outlines_processor(hf, tokenizer, peers.PERSON_SCHEMA)
    peer_call = lambda: peers.hf_generate(hf, tokenizer, prompt, 64, processor)[0][0]  # noqa: E731
    return [
        row("json latency", "foveal, jump-forward on", results[True]),
        row("json latency", "foveal, jump-forward off", results[False]),
        row("json latency", "transformers + outlines", median_calls({0: peer_call}, calls)[0]),
    ]


def median_calls(contenders: dict[Any, Any], calls: int) -> dict[Any, dict[str, Any]]:
    """Each contender's median seconds per call over `calls` rounds (one call each per round, after a warm one)."""
    times: dict[Any, list[float]] = {name: [] for name in contenders}
    valid = dict.fromkeys(contenders, 0)
    for call in contenders.values():
        call()  # warm
    for _ in range(calls):
        for name, call in contenders.items():
            started = time.perf_counter()
            text = _guarded(call)
            times[name].append(time.perf_counter() - started)
            valid[name] += peers.valid_json(text)
    out = {}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        out[name] = {"wall_s": median, "req_s": 1 / median, "median_ms": 1e3 * median, "valid": valid[name], "n": calls}
    return out


# ---- 4. the peers workloads ------------------------------------------------------------------------------


def concurrent(model: foveal.Model, hf: Any, n: int) -> list[dict]:
    rows = []
    for workload in (peers.json_workload(n), peers.detect_workload(n)):
        def ours(workload=workload):
            outputs, _, wall, _ = peers.foveal_calls(model, workload, True)
            valid = sum(peers.is_valid(workload, o) for o in outputs)
            return {"wall_s": wall, "req_s": n / wall, "valid": valid, "n": n}

        prompts = peers.prompt_ids(model, workload)
        valid = lambda o, w=workload: peers.is_valid(w, o)  # noqa: E731
        rows.append(row(workload.name, "foveal", warm_and_time(ours)))
        rows.append(row(workload.name, "transformers + outlines", warm_and_time(
            lambda w=workload, p=prompts, v=valid: peer(hf, model.family.tokenizer, p, w.max_tokens, w.outlines_type, v))))
    return rows


# ---- the table -------------------------------------------------------------------------------------------


def row(workload: str, contender: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"workload": workload, "contender": contender, **result}


def ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    by = {(r["workload"], r["contender"]): r for r in rows}

    def ratio(workload, ours, theirs):
        return by[(workload, ours)]["req_s"] / by[(workload, theirs)]["req_s"]

    peer_name = "transformers + outlines"
    found = {
        "shared prefix": ratio("shared prefix", "foveal", peer_name),
        "image objects (cache on/off)": ratio("image objects", "foveal, prefix cache on", "foveal, prefix cache off"),
        "image objects": ratio("image objects", "foveal, prefix cache on", peer_name),
        "json latency (jump-forward on/off)": ratio("json latency", "foveal, jump-forward on", "foveal, jump-forward off"),
        "json latency": ratio("json latency", "foveal, jump-forward on", peer_name),
        "json": ratio("json", "foveal", peer_name),
        "detect": ratio("detect", "foveal", peer_name),
    }
    return {k: {"ratio": v, "target": TARGETS.get(k)} for k, v in found.items()}


def print_table(report: dict[str, Any]) -> None:
    print(f"less work per answer: {report['model']}, greedy, CPU")
    head = f"{'workload':<14} {'contender':<32} {'req/s':>7} {'wall s':>8} {'valid':>7}"
    print(head)
    print("-" * len(head))
    for r in report["rows"]:
        print(f"{r['workload']:<14} {r['contender']:<32} {r['req_s']:>7.2f} {r['wall_s']:>8.2f} {r['valid']:>3}/{r['n']:<3}")
    for label, v in report["ratios"].items():
        target = f" (target >= {v['target']:.1f}x: {'met' if v['ratio'] >= v['target'] else 'MISSED'})" if v["target"] else ""
        print(f"  foveal {label}: {v['ratio']:.2f}x{target}")


def run(quick: bool, calls: int = 5, device: str = "cpu") -> dict[str, Any]:
    n, doc_tokens, n_images, per_image = (4, 120, 2, 2) if quick else (32, 600, 4, 8)
    with tempfile.TemporaryDirectory() as tmp:
        source = peers.tiny_llama_folder(Path(tmp) / "llama") if quick else smollm2_folder()
        vlm = vlm_folder(Path(tmp) / "vlm", None if quick else source)
        hf = peers.reference_model(source, device)
        with foveal.load(source, device=device, max_batch_size=n, max_model_len=1024) as model:
            rows = shared_prefix(model, hf, n, doc_tokens)
            rows += concurrent(model, hf, n)
        rows += json_latency(source, hf, calls, device)
        rows += image_objects(vlm, n_images, per_image, device)
    return {"model": "tiny random (--quick)" if quick else "SmolLM2-135M-Instruct", "rows": rows,
            "ratios": ratios(rows)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny random models: a smoke run, not a measurement")
    parser.add_argument("--calls", type=int, default=5, help="batch-1 calls per contender (median)")
    parser.add_argument("--out", default="out/benchmarks/less_work.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = run(args.quick, args.calls)
    print_table(report)
    print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
