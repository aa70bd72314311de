"""Memory over repeated load -> call -> close cycles: does a process that reloads a model grow?

    python -m benchmarks.leaks [--cycles 8] [--model embedded|tiny-llama|PATH] [--global-unit] [--out out/benchmarks/leaks.json]

Each cycle loads the model with `foveal.load`, makes one call (a 10-token `generate`: a prefill and
traced decode steps), closes the model, drops it and collects garbage; then it records the process's
RSS (after `malloc_trim`, so freed heap pages are returned and only live memory counts) and how many
of that cycle's weight storages are still alive (weak references to the C++ storages, which outlive
their Python `Parameter` objects when something native holds them).

--global-unit re-creates the defect of issue 13 for comparison: decode traces are compiled into
torch's process-wide TorchScript unit again (engine/models/traced.py's `own_compilation_unit` off),
where each trace kept its model's weights alive as graph constants.

Models: `embedded` (foveal.load(), the default), `tiny-llama` (a random tiny Llama built from its
config by foveal.testing.tiny, text-only), or a checkpoint folder.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import platform
import tempfile
from pathlib import Path

import psutil
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import foveal
from benchmarks import write_json
from foveal.engine.models import traced
from foveal.vision import scenes


def _trim() -> None:
    """Return freed heap pages to the OS (glibc), so RSS follows live memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _source(model: str, workdir: Path) -> str | None:
    if model == "embedded":
        return None
    if model == "tiny-llama":
        from foveal.testing import tiny

        return str(tiny.build("llama", workdir / "tiny-llama"))
    return model


def cycle(source: str | None, image) -> tuple[int, int]:
    """One load -> call -> close; returns (weight storages, of which still alive after close + gc)."""
    model = foveal.load(source, device="cpu")
    weights = [StorageWeakRef(p.untyped_storage()) for p in model.family.runner.model.parameters()]
    vision = model.family.capabilities.vision
    model.generate(image if vision else None, "hi", settings={"max_tokens": 10})
    model.close()
    del model
    gc.collect()
    return len(weights), sum(not w.expired() for w in weights)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--model", default="embedded", help="embedded, tiny-llama or a checkpoint folder")
    parser.add_argument(
        "--global-unit", action="store_true", help="trace into torch's global unit (the old defect)"
    )
    parser.add_argument("--out", default="out/benchmarks/leaks.json")
    args = parser.parse_args(argv)
    if args.global_unit:
        traced.own_compilation_unit = contextlib.nullcontext
    image = scenes.render(scenes.generate_scene(1))
    process = psutil.Process()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        source = _source(args.model, Path(workdir))
        _trim()
        start = process.memory_info().rss
        print(f"{'cycle':>5} {'rss MB':>8} {'grown MB':>9} {'weights alive':>14}")
        for number in range(1, args.cycles + 1):
            total, alive = cycle(source, image)
            _trim()
            rss = process.memory_info().rss
            rows.append(
                {
                    "cycle": number,
                    "rss_mb": rss / 2**20,
                    "grown_mb": (rss - start) / 2**20,
                    "weights": total,
                    "weights_alive": alive,
                }
            )
            print(f"{number:>5} {rss / 2**20:>8.1f} {(rss - start) / 2**20:>9.1f} {alive:>6} of {total:<5}")
    # growth per cycle over the second half: the first cycles pay one-time costs (imports, allocator pools)
    half = len(rows) // 2
    per_cycle = (rows[-1]["rss_mb"] - rows[half]["rss_mb"]) / max(1, len(rows) - 1 - half)
    print(
        f"growth per cycle, last {len(rows) - half} cycles: {per_cycle:.2f} MB ({args.model}, global unit: {args.global_unit})"
    )
    meta = {
        "model": args.model,
        "global_unit": args.global_unit,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "growth_per_cycle_mb": per_cycle,
    }
    print(f"wrote {write_json(args.out, {'meta': meta, 'rows': rows})}")


if __name__ == "__main__":
    main()
