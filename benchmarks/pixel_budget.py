"""Memory of concurrent image decodes: full decodes vs reduced decodes, under a PixelBudget.

    python -m benchmarks.pixel_budget [--images 16] [--side 7000] [--budget 100000000] [--unbounded]
                                      [--out out/benchmarks/pixel_budget.json]

A near-uniform SIDE x SIDE JPEG (under a megabyte, like the one that took a server from 665 MB to
1.2 GB RSS per detect) is built in memory with PIL. Each configuration then runs in a fresh Python
process, so that its peak RSS is its own: --images threads start together and each does the image
step of one call: decode the bytes (`foveal.vision.load_image` semantics, through
`PixelBudget.load`), key the decoded image (`image_key`), and resize it the way the embedded model's
processor does (size and resample from its preprocessor_config.json), holding the budget until the
processor's pixels exist. Configurations:
    full unbounded   every thread decodes the whole image at once (the old behaviour; --unbounded)
    full             whole decodes under the budget (--budget pixels held at once)
    full, mmap 1MB   the same with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_): freed
                     blocks go back to the OS instead of staying in per-thread arenas
    reduced          decodes reduced to the processor's target (JPEG DCT scaling), under the budget
    reduced progr.   the same from a progressive JPEG, whose decoder buffers the whole image anyway
    sdk detect       --images concurrent `model.detect` calls of the embedded model (`foveal.load()`,
                     its default pixel budget) on the JPEG bytes: the whole call, engine included
Reported per configuration: RSS before the decodes (after imports), peak RSS (VmHWM), RSS after the
threads ended, RSS after malloc_trim (what the allocator kept vs what is live), the budget's peak
pixels, its timeouts, and the wall time of the step. Except in "sdk detect", the SDK's engine and
model weights are not loaded: the figures are the decode's part of a call's memory.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

import numpy as np
import PIL
import psutil
from PIL import Image

from benchmarks import write_json
from foveal.vision import PixelBudget, PixelBudgetTimeout, image_key
from foveal.vision.budget import DEFAULT_PIXEL_BUDGET

# name: (reduced decode, progressive JPEG, under the budget, environment of the process)
CONFIGS: dict[str, tuple[bool, bool, bool, dict[str, str]]] = {
    "full unbounded": (False, False, False, {}),
    "full": (False, False, True, {}),
    # glibc keeps freed memory of per-thread arenas (its mmap threshold rises after the first large
    # free); a fixed threshold sends large blocks to mmap, returned on free.
    "full, mmap 1MB": (False, False, True, {"MALLOC_MMAP_THRESHOLD_": str(2**20)}),
    "reduced": (True, False, True, {}),
    "reduced progr.": (True, True, True, {}),
    "sdk detect": (True, False, True, {}),
}


def embedded_target() -> tuple[tuple[int, int], int]:
    """The embedded model's processor target (width, height) and PIL resample filter."""
    config = json.loads((resources.files("foveal") / "embedded" / "preprocessor_config.json").read_text())
    return (config["size"]["width"], config["size"]["height"]), config.get("resample", 3)


def near_uniform_jpeg(side: int, progressive: bool) -> bytes:
    """A grey SIDE x SIDE JPEG with faint smooth variation: under a megabyte encoded."""
    rng = np.random.default_rng(0)
    cells = rng.integers(120, 136, (max(side // 500, 2), max(side // 500, 2), 3), dtype=np.uint8)
    image = Image.fromarray(cells).resize((side, side), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=85, progressive=progressive)
    return buffer.getvalue()


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _peak_rss() -> int:
    """VmHWM, the process's peak resident set, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _measured(work, images: int, budget: PixelBudget) -> dict:
    """Run `work` on `images` threads released together; the process's memory figures around it."""
    process = psutil.Process()
    gc.collect()
    before = process.memory_info().rss
    start = threading.Barrier(images)

    def run() -> None:
        start.wait()
        work()

    threads = [threading.Thread(target=run) for _ in range(images)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    peak = _peak_rss()
    gc.collect()
    after = process.memory_info().rss
    _trim()
    stats = budget.stats()
    return {
        "rss_before_mb": before / 2**20,
        "peak_rss_mb": peak / 2**20,
        "rss_after_mb": after / 2**20,
        "rss_after_trim_mb": process.memory_info().rss / 2**20,
        "peak_added_mb": (peak - before) / 2**20,
        "held_after_mb": (after - before) / 2**20,
        "budget_peak_pixels": stats["peak"],
        "timeouts": stats["timeouts"],
        "wall_s": wall,
    }


def sdk_child(data_file: str, images: int) -> dict:
    """`images` concurrent detect calls of the embedded model on the JPEG, in this (fresh) process."""
    import foveal

    data = Path(data_file).read_bytes()
    model = foveal.load(device="cpu")
    model.detect(near_uniform_jpeg(64, False), "circle")  # warm: traces and first-call costs
    answers: list[int] = []
    figures = _measured(
        lambda: answers.append(len(model.detect(data, "circle")["objects"])), images, model.pixels
    )
    model.close()
    return {
        **figures,
        "served": len(answers),
        "distinct_keys": 1,
        "decoded": [f"{len(answers)} answers"],
        "errors": [],
    }


def child(
    data_file: str, images: int, reduced: bool, bounded: bool, budget_pixels: int, timeout_s: float
) -> dict:
    """One configuration, in this (fresh) process: `images` concurrent image steps; its figures."""
    data = Path(data_file).read_bytes()
    target, resample = embedded_target()
    budget = PixelBudget(budget_pixels if bounded else 10**12, timeout_s=timeout_s)
    keys: list[str] = []
    errors: list[str] = []

    def step() -> None:
        try:
            with budget.load(data, min_size=target if reduced else None) as decoded:
                key = image_key(decoded)
                pixels = np.asarray(decoded.resize(target, resample), dtype=np.float32) / 127.5 - 1
            keys.append(f"{key}:{decoded.width}x{decoded.height}:{pixels.shape}")
        except PixelBudgetTimeout as error:
            errors.append(str(error))

    figures = _measured(step, images, budget)
    return {
        **figures,
        "served": len(keys),
        "distinct_keys": len(set(keys)),
        "decoded": sorted(set(k.split(":", 1)[1] for k in keys)),
        "errors": errors[:1],
    }


COLUMNS = {  # key: (header, format)
    "rss_before_mb": ("before MB", "{:.0f}"),
    "peak_rss_mb": ("peak MB", "{:.0f}"),
    "rss_after_mb": ("after MB", "{:.0f}"),
    "rss_after_trim_mb": ("trimmed MB", "{:.0f}"),
    "peak_added_mb": ("peak +MB", "{:.0f}"),
    "budget_peak_pixels": ("budget peak px", "{:,}"),
    "timeouts": ("timeouts", "{}"),
    "wall_s": ("wall s", "{:.2f}"),
}


def table(rows: dict[str, dict]) -> str:
    lines = [f"{'config':16}" + "".join(f"{h:>16}" for h, _ in COLUMNS.values()) + "  decoded"]
    for name, row in rows.items():
        cells = "".join(f"{fmt.format(row[k]):>16}" for k, (_, fmt) in COLUMNS.items())
        lines.append(f"{name:16}{cells}  {', '.join(row['decoded'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=16, help="concurrent image steps")
    parser.add_argument("--side", type=int, default=7000, help="the JPEG's width and height")
    parser.add_argument("--budget", type=int, default=DEFAULT_PIXEL_BUDGET, help="PixelBudget max_pixels")
    parser.add_argument("--timeout", type=float, default=120.0, help="PixelBudget wait before a timeout (s)")
    parser.add_argument(
        "--unbounded", action="store_true", help="also run full decodes with no budget (needs ~6 GB at 16)"
    )
    parser.add_argument("--out", default="out/benchmarks/pixel_budget.json")
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        reduced, _, bounded, _ = CONFIGS[args.child]
        if args.child == "sdk detect":
            print(json.dumps(sdk_child(args.data, args.images)))
            return
        print(json.dumps(child(args.data, args.images, reduced, bounded, args.budget, args.timeout)))
        return
    target, resample = embedded_target()
    names = [name for name in CONFIGS if args.unbounded or name != "full unbounded"]
    rows, sizes = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for progressive in (False, True):
            data = near_uniform_jpeg(args.side, progressive)
            sizes["progressive" if progressive else "baseline"] = len(data)
            (Path(folder) / f"{progressive}.jpg").write_bytes(data)
        for name in names:
            file = Path(folder) / f"{CONFIGS[name][1]}.jpg"
            command = [sys.executable, "-m", "benchmarks.pixel_budget", "--child", name, "--data", str(file)]
            command += [
                "--images",
                str(args.images),
                "--budget",
                str(args.budget),
                "--timeout",
                str(args.timeout),
            ]
            env = {**os.environ, **CONFIGS[name][3]}
            done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
            rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"{args.images} concurrent image steps on a {args.side}x{args.side} JPEG ({sizes['baseline']:,} bytes; "
        f"progressive {sizes['progressive']:,}); target {target[0]}x{target[1]} (embedded processor), "
        f"budget {args.budget:,} pixels"
    )
    print(table(rows))
    meta = {
        "images": args.images,
        "side": args.side,
        "jpeg_bytes": sizes,
        "target": target,
        "resample": resample,
        "budget_pixels": args.budget,
        "timeout_s": args.timeout,
        "pillow": PIL.__version__,
        "python": platform.python_version(),
        "machine": platform.platform(),
        "cpus": psutil.cpu_count(),
    }
    print(f"wrote {write_json(args.out, {'meta': meta, 'rows': rows})}")


if __name__ == "__main__":
    main()
