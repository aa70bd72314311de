"""Several calls on one image: what each call spends on the image, and what reuse saves.

    python -m benchmarks.image_reuse [--model PATH] [--calls 8] [--out out/benchmarks/image_reuse.json] [--quick]

For each input (a 160 px shapes scene as PNG bytes, a 1920x1080 and a 4000x3000 JPEG), it measures
(medians of --repeat runs, milliseconds):
  - decode: `load_image` (decode, EXIF, RGB), key: `image_key` (hash of the pixels),
    preprocess: the model's processor (resize, normalize, prompt ids),
    vision: the model's vision tower + projector on those pixels (`get_image_features`);
  - per call, detect with the raw bytes each time vs with `model.encode_image(bytes)` made once:
    the SDK-side reuse (decode and key skipped) that exists today.
The vision encoding is not yet cached by the runner: the `vision` column is what a runner cache
keyed by `extras["image_key"]` would save per call after the first (not measured end to end:
the cache does not exist yet). Model: --model, else the embedded architecture (train_shapes'
default config) with untrained weights, exported to a temporary folder (same cost per call).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import foveal
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
    from foveal import train_shapes

    folder = Path(tempfile.mkdtemp(prefix="foveal-bench-"))
    return train_shapes.Trainer(train_shapes.TrainConfig()).export(folder, dtype=torch.float32)


def measure(model: foveal.Model, data: bytes, calls: int, repeat: int) -> dict:
    pil = load_image(data)
    prompt = model.skills.detect("red circle", SETTINGS["max_objects"]).prompt
    pixels = model.loaded.processor(prompt, pil).extras["pixel_values"]
    hf = model.loaded.runner.model
    model.detect(data, "red circle", SETTINGS)  # warm-up: traces, grammar compile

    def vision():
        with torch.inference_mode():
            hf.get_image_features(pixels)

    def raw_calls():
        for _ in range(calls):
            model.detect(data, "red circle", SETTINGS)

    def reused_calls():
        encoded = model.encode_image(data)
        for _ in range(calls):
            model.detect(encoded, "red circle", SETTINGS)

    raw, reused = [], []
    for _ in range(repeat):  # interleaved, so load from other processes hits both alike
        raw.append(median_ms(raw_calls, 1) / calls)
        reused.append(median_ms(reused_calls, 1) / calls)
    row = {
        "bytes": len(data),
        "decode_ms": median_ms(lambda: load_image(data), repeat),
        "key_ms": median_ms(lambda: image_key(pil), repeat),
        "preprocess_ms": median_ms(lambda: model.loaded.processor(prompt, pil), repeat),
        "vision_ms": median_ms(vision, repeat),
        "raw_per_call_ms": statistics.median(raw),
        "encoded_per_call_ms": statistics.median(reused),
    }
    row["saved_per_call_ms"] = row["raw_per_call_ms"] - row["encoded_per_call_ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint folder (default: untrained embedded architecture)"
    )
    parser.add_argument("--calls", type=int, default=8, help="calls on the same image")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement; the median is reported")
    parser.add_argument("--out", default="out/benchmarks/image_reuse.json")
    parser.add_argument("--quick", action="store_true", help="two inputs, 2 repeats (smoke run)")
    args = parser.parse_args(argv)
    repeat = 2 if args.quick else args.repeat
    path = args.model or default_model()
    rows = {}
    with foveal.load(path, device="cpu", max_batch_size=8) as model:
        for name, data in inputs(args.quick).items():
            rows[name] = measure(model, data, args.calls, repeat)
    columns = ["decode_ms", "key_ms", "preprocess_ms", "vision_ms", "raw_per_call_ms", "encoded_per_call_ms"]
    print(f"{'input':24}" + "".join(f"{c:>22}" for c in columns))
    for name, row in rows.items():
        print(f"{name:24}" + "".join(f"{row[c]:22.2f}" for c in columns))
    meta = {
        "model": str(path),
        "calls": args.calls,
        "repeat": repeat,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "settings": SETTINGS,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
