"""Several calls on one image: what each call spends on the image, and what reuse saves, end to end.

    python -m benchmarks.image_reuse [--model PATH] [--calls 8] [--cache-bytes N] [--out out/benchmarks/image_reuse.json] [--quick]

For each input (a 160 px shapes scene as PNG bytes, a 1920x1080 and a 4000x3000 JPEG), it measures
(medians over --repeat runs, milliseconds):
  - the parts of one call's image work: decode: `load_image` (decode, EXIF, RGB), key: `image_key`
    (hash of the pixels), preprocess: the model's processor (resize, normalize, prompt ids),
    vision: the model's vision tower + projector on those pixels (`get_image_features`);
  - per call, mean over --calls calls (detect, or --skill query) on the same image (the first call included), through
    `foveal.load(...)` and its engine, in three set-ups run interleaved:
      uncached: the raw bytes each call, the runner's image-feature cache off (`resize(0)`): every
                call decodes, keys, preprocesses and encodes;
      raw:      the raw bytes each call, the cache on (`--cache-bytes`): the vision tower runs once;
      encoded:  `model.encode_image(bytes)` once (timed), then the cache on: decode and key run once too;
    hit_call_ms is the median of calls 2..N with the cache on (raw bytes), vision_share the vision
    column over the uncached per-call time, and hits/misses the cache's counts in the raw runs;
  - per call, the time spent inside the runner's `encode_images` (the vision tower in the engine's
    prefill), cache off vs on: the saving itself, apart from the noise of whole calls on a shared CPU.
Model: --model, else the embedded architecture (train_shapes' default config) with untrained
weights, exported to a temporary folder (same cost per call as trained weights).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import foveal
from benchmarks import write_json
from foveal.vision import image_key, load_image, scenes

SETTINGS = {"max_objects": 4, "max_tokens": 32}


def inputs(quick: bool) -> dict[str, bytes]:
    scene = scenes.render(scenes.generate_scene(1, 160))
    out = {"scene 160x160 png": _encode(scene, "PNG")}
    sizes = [(1920, 1080)] if quick else [(1920, 1080), (4000, 3000)]
    rng = np.random.default_rng(0)
    for w, h in sizes:
        # Smooth noise, so JPEG sizes look like a photo's rather than white noise.
        small = rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8)
        photo = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
        out[f"photo {w}x{h} jpeg"] = _encode(photo, "JPEG")
    return out


def _encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, quality=90)
    return buffer.getvalue()


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def default_model() -> Path:
    from foveal.training import train_shapes

    folder = Path(tempfile.mkdtemp(prefix="foveal-bench-"))
    return train_shapes.Trainer(train_shapes.TrainConfig()).export(folder, dtype=torch.float32)


QUESTION = "what is red?"


def call(model: foveal.Model, image, settings: dict) -> None:
    """One call: detect by default; with settings["skill"] == "query", a question cut at max_tokens."""
    if settings.get("skill", "detect") == "query":
        model.query(image, QUESTION, settings={"max_tokens": settings["max_tokens"]})
    else:
        model.detect(image, "red circle", {k: v for k, v in settings.items() if k != "skill"})


def timed_calls(model: foveal.Model, image, calls: int, settings: dict) -> list[float]:
    """Milliseconds of each of `calls` calls on `image`."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call(model, image, settings)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


class EncoderClock:
    """Time spent inside the runner's `encode_images` (the vision tower), summed per named section."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.ms: dict[str, float] = {}

    @contextlib.contextmanager
    def section(self, name: str):
        inner = self.runner.encode_images
        self.ms.setdefault(name, 0.0)

        def timed(extras):
            t0 = time.perf_counter()
            out = inner(extras)
            if out and out[0].is_cuda:
                torch.cuda.synchronize()
            self.ms[name] += 1e3 * (time.perf_counter() - t0)
            return out

        self.runner.encode_images = timed  # an instance attribute shadows the method
        try:
            yield
        finally:
            del self.runner.encode_images


def measure(
    model: foveal.Model,
    data: bytes,
    calls: int,
    repeat: int,
    cache_bytes: int | None = None,
    settings: dict = SETTINGS,
) -> dict:
    """One input's row; `cache_bytes`: the cache bound for the cached runs (default: the runner's own)."""
    pil = load_image(data)
    if settings.get("skill", "detect") == "query":
        task = model.family.query(QUESTION)
    else:
        task = model.family.detect("red circle", settings["max_objects"])
    pixels = model.family.encode(task, [pil], None)[0].prefill.image_tensors["pixel_values"]
    hf = model.family.runner.model
    cache = model.family.runner.image_cache
    bound = cache.max_bytes if cache_bytes is None else cache_bytes
    call(model, data, settings)  # warm-up: traces, grammar compile

    def vision():
        with torch.inference_mode():
            hf.get_image_features(pixels)

    uncached, raw, encoded, hits = [], [], [], []
    encoder = EncoderClock(model.family.runner)
    stats = cache.stats
    for _ in range(repeat):  # interleaved, so load from other processes hits all set-ups alike
        cache.resize(0)  # between calls only: the cache is the device thread's while a request runs
        with encoder.section("uncached"):
            uncached.append(timed_calls(model, data, calls, settings))
        cache.resize(bound)
        cache.clear()
        before = (stats.hits, stats.misses)
        with encoder.section("cached"):
            raw.append(timed_calls(model, data, calls, settings))
        hits.append((stats.hits - before[0], stats.misses - before[1]))
        cache.clear()
        t0 = time.perf_counter()
        image = model.encode_image(data)
        first = 1e3 * (time.perf_counter() - t0)
        times = timed_calls(model, image, calls, settings)
        times[0] += first  # encode_image is part of the first call's cost
        encoded.append(times)
    per_call = lambda runs: statistics.median(sum(r) / calls for r in runs)  # noqa: E731
    row = {
        "bytes": len(data),
        "decode_ms": median_ms(lambda: load_image(data), repeat),
        "key_ms": median_ms(lambda: image_key(pil), repeat),
        "preprocess_ms": median_ms(lambda: model.family.encode(task, [pil], None), repeat),
        "vision_ms": median_ms(vision, repeat),
        "uncached_per_call_ms": per_call(uncached),
        "raw_per_call_ms": per_call(raw),
        "encoded_per_call_ms": per_call(encoded),
        "encoder_uncached_per_call_ms": encoder.ms["uncached"] / (repeat * calls),
        "encoder_cached_per_call_ms": encoder.ms["cached"] / (repeat * calls),
        "hit_call_ms": statistics.median(t for r in raw for t in r[1:]) if calls > 1 else None,
        "cache_hits": hits[-1][0],
        "cache_misses": hits[-1][1],
        "cache_bytes": bound,
    }
    row["vision_share"] = row["vision_ms"] / row["uncached_per_call_ms"]
    row["saved_per_call_ms"] = row["uncached_per_call_ms"] - row["encoded_per_call_ms"]
    return row


COLUMNS = {  # key: header
    "decode_ms": "decode",
    "key_ms": "key",
    "preprocess_ms": "preproc",
    "vision_ms": "vision",
    "uncached_per_call_ms": "uncached/call",
    "raw_per_call_ms": "cached/call",
    "encoded_per_call_ms": "+encoded/call",
    "hit_call_ms": "hit call",
    "encoder_uncached_per_call_ms": "enc/call off",
    "encoder_cached_per_call_ms": "enc/call on",
    "vision_share": "vision share",
}


def table(rows: dict[str, dict], calls: int) -> str:
    lines = [
        f"{calls} calls per image; ms (vision share: vision / uncached per call; hits/misses: last cached run)",
        f"{'input':22}" + "".join(f"{h:>15}" for h in COLUMNS.values()) + f"{'hits/misses':>13}",
    ]
    for name, row in rows.items():
        cells = "".join(f"{row[k]:15.2f}" if row[k] is not None else f"{'-':>15}" for k in COLUMNS)
        lines.append(f"{name:22}{cells}{row['cache_hits']:>8}/{row['cache_misses']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint folder (default: untrained embedded architecture)"
    )
    parser.add_argument("--calls", type=int, default=8, help="calls on the same image")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement; the median is reported")
    parser.add_argument(
        "--cache-bytes",
        type=int,
        default=None,
        help="image-feature cache bound when on (default: the runner's)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=SETTINGS["max_tokens"],
        help="answer budget per call (short: prefill-bound)",
    )
    parser.add_argument(
        "--skill",
        choices=["detect", "query"],
        default="detect",
        help="the call made on the image; query answers are cut at --max-tokens (detect needs room to complete)",
    )
    parser.add_argument("--out", default="out/benchmarks/image_reuse.json")
    parser.add_argument("--quick", action="store_true", help="two inputs, 2 repeats (smoke run)")
    args = parser.parse_args(argv)
    repeat = 2 if args.quick else args.repeat
    path = args.model or default_model()
    settings = {**SETTINGS, "max_tokens": args.max_tokens, "skill": args.skill}
    rows = {}
    with foveal.load(path, device="cpu", max_batch_size=8) as model:
        for name, data in inputs(args.quick).items():
            rows[name] = measure(model, data, args.calls, repeat, args.cache_bytes, settings)
    print(f"{settings['skill']}, max_tokens {settings['max_tokens']}: " + table(rows, args.calls))
    meta = {
        "model": str(path),
        "calls": args.calls,
        "cache_bytes": args.cache_bytes,
        "repeat": repeat,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "settings": settings,
    }
    print(f"wrote {write_json(args.out, {'meta': meta, 'rows': rows})}")


if __name__ == "__main__":
    main()
