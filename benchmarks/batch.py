"""Batch throughput: `foveal batch` locally vs a naive loop of `model.detect` calls, and on local Ray.

    python -m benchmarks.batch [--images 256] [--size 64] [--model PATH] [--no-ray] [--out out/benchmarks/batch.json]

Workload: detect "shape" on --images generated shapes scenes (PNG files of --size px, decoded from
disk by every contender, as a real job would). Contenders, one model each (the embedded one, or
--model), run one after another after an untimed warm-up:
  naive:      `for path in paths: model.detect(path, "shape")`, one request in the engine at a time;
  model.map:  the SDK's list call (a window of requests, images prepared on the calling thread);
  batch:      `foveal.batch.run(folder, ...)` into a JSONL file: images read ahead on worker threads,
              2 x max_batch_size calls in flight;
  ray:        `foveal.batch.ray_job.run_on_ray` on a local Ray instance (ray.init(num_cpus=2 here),
              one actor holding its own model; Ray start-up and the actor's model load excluded,
              the dataset's execution included).
Per contender: images/s, speed-up over naive, the engine's mean rows per step (decode, prefill;
`Engine.stats()` over the timed run; Ray's engines live in the actors: not measured).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import foveal
from benchmarks import write_json
from foveal import batch
from foveal.batch.runner import counts_delta, engine_counts
from foveal.vision import scenes

PHRASE = "shape"


def write_images(folder: Path, n: int, size: int) -> list[str]:
    paths = []
    for seed in range(n):
        path = folder / f"scene{seed:05d}.png"
        scenes.render(scenes.generate_scene(10_000 + seed, size)).save(path)
        paths.append(str(path))
    return paths


def timed(name: str, model, work) -> dict:
    before = engine_counts(model)  # None without a model (Ray's engines are in its actors)
    started = time.perf_counter()
    n = work()
    seconds = time.perf_counter() - started
    row = {"contender": name, "images": n, "seconds": seconds, "images_per_s": n / seconds}
    if before is not None:
        decode, prefill, steps = counts_delta(before, engine_counts(model))
        row["decode_rows_per_step"] = decode / max(steps, 1)
        row["prefill_rows_per_step"] = prefill / max(steps, 1)
    return row


def run(images: int, size: int, model_path: str | None, use_ray: bool, work_dir: Path) -> dict:
    folder = work_dir / "images"
    folder.mkdir()
    paths = write_images(folder, images, size)
    model = foveal.load(model_path, device="cpu")
    try:
        model.map("detect", paths[:8], PHRASE, progress=False)  # warm-up: traces, grammar compile
        rows = [
            timed("naive", model, lambda: sum(1 for p in paths if model.detect(p, PHRASE) is not None)),
            timed("model.map", model, lambda: len(model.map("detect", paths, PHRASE, progress=False))),
        ]
        out = work_dir / "local.jsonl"
        rows.append(
            timed(
                "batch",
                model,
                lambda: (
                    batch.run(folder, "detect", object=PHRASE, model=model, out=out, progress=False)
                    .run()
                    .done
                ),
            )
        )
        max_batch = model.config.max_batch
    finally:
        model.close()
    if use_ray:
        rows.append(ray_row(folder, model_path, work_dir, out))
    naive = rows[0]["images_per_s"]
    for row in rows:
        row["speedup_vs_naive"] = row["images_per_s"] / naive
    meta = {
        "images": images,
        "size": size,
        "model": model_path or "embedded",
        "max_batch_size": max_batch,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch_threads": __import__("torch").get_num_threads(),
    }
    return {"meta": meta, "rows": rows}


def ray_row(folder: Path, model_path: str | None, work_dir: Path, local_out: Path) -> dict:
    import ray

    from foveal.batch.ray_job import run_on_ray

    ray.init(
        num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False, configure_logging=False
    )
    try:
        warm = work_dir / "warm.txt"
        warm.write_text("\n".join(sorted(str(p) for p in folder.glob("*.png"))[:4]))
        # The warm-up starts an actor pool of its own; its cost shows apart from the timed run's.
        started = time.perf_counter()
        run_on_ray(
            warm, "detect", object=PHRASE, model=model_path, out=work_dir / "warm.jsonl", progress=False
        )
        startup = time.perf_counter() - started
        out = work_dir / "ray.jsonl"
        row = timed(
            "ray",
            None,
            lambda: (
                run_on_ray(folder, "detect", object=PHRASE, model=model_path, out=out, progress=False).done
            ),
        )
        row["actor_startup_s"] = startup
        row["same_lines_as_batch"] = out.read_text() == local_out.read_text()
        return row
    finally:
        ray.shutdown()


def print_table(report: dict) -> None:
    meta = report["meta"]
    print(
        f"detect {PHRASE!r} on {meta['images']} scenes of {meta['size']} px, max_batch_size {meta['max_batch_size']}"
    )
    print(
        f"{'contender':<10} {'images/s':>9} {'x naive':>8} {'decode rows/step':>17} {'prefill rows/step':>18}"
    )
    for row in report["rows"]:
        decode = f"{row['decode_rows_per_step']:.1f}" if "decode_rows_per_step" in row else "-"
        prefill = f"{row['prefill_rows_per_step']:.1f}" if "prefill_rows_per_step" in row else "-"
        print(
            f"{row['contender']:<10} {row['images_per_s']:>9.1f} {row['speedup_vs_naive']:>8.2f} {decode:>17} {prefill:>18}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--size", type=int, default=64, help="scene side in pixels")
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray contender")
    parser.add_argument("--out", default="out/benchmarks/batch.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        report = run(args.images, args.size, args.model, not args.no_ray, Path(work))
    print_table(report)
    print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
