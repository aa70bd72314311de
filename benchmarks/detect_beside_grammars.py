"""A detect call beside callers whose output grammars are pathological: does it wait for them?

    python -m benchmarks.detect_beside_grammars [--rounds 12] [--alternatives 60000] [--out FILE]

The embedded model (`foveal.load()`) answers `detect(scene, "circle")` from the main thread:
    alone
    beside 2 pathological      two threads call `generate(scene, "x", foveal.CFG(grammar))` back to
                               back with a Lark grammar of --alternatives literal alternatives
                               (`start: "a0" | "a1" | ...`), which the compile budget refuses
    beside 2 paced             the same callers, 10 ms between a caller's attempts (a client that
                               sends its next request after the refusal came back)
    beside 2 busy threads      two threads running a busy loop of plain Python: the GIL's share
                               alone, for reference (a back-to-back refusal is such a loop)
Blocks of the conditions alternate (the machine is shared); each row is the median and max of
--rounds detect calls per block. Before compiles left the model's lock, every other caller's detect
waited behind such a grammar (seconds per grammar); the target is a detect beside two of them within
3x of a detect alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time

import foveal
from benchmarks import write_json
from foveal.grammars import SchemaError
from foveal.vision import scenes


def _grammar(n: int) -> str:
    return "start: " + " | ".join(f'"a{i}"' for i in range(n))


def _detect_times(model: foveal.Model, image, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        model.detect(image, "circle")
        times.append(time.perf_counter() - t0)
    return times


def _callers(
    model: foveal.Model, image, grammar: str | None, pause_s: float, stop: threading.Event
) -> tuple[list, list]:
    """Two threads: refused generate calls (`grammar`), `pause_s` apart, or (grammar None) busy loops."""
    refusals: list[float] = []
    threads = []

    def caller() -> None:
        while not stop.is_set():
            if grammar is None:
                sum(range(1000))
                continue
            t0 = time.perf_counter()
            try:
                model.generate(image, "x", foveal.CFG(grammar))
            except SchemaError:
                refusals.append(time.perf_counter() - t0)
            stop.wait(pause_s)

    for _ in range(2):
        thread = threading.Thread(target=caller, daemon=True)
        thread.start()
        threads.append(thread)
    return threads, refusals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12, help="detect calls per block")
    parser.add_argument("--blocks", type=int, default=3, help="alternating blocks of each condition")
    parser.add_argument("--alternatives", type=int, default=60_000)
    parser.add_argument("--out", default="out/benchmarks/detect_beside_grammars.json")
    args = parser.parse_args(argv)
    grammar = _grammar(args.alternatives)
    image = scenes.render(scenes.generate_scene(0, 160))
    with foveal.load(device="cpu") as model:
        _detect_times(model, image, 3)  # warm: traces, the detect grammar's compile
        conditions = {
            "detect alone": None,
            "detect beside 2 pathological": (grammar, 0.0),
            "detect beside 2 paced": (grammar, 0.01),
            "detect beside 2 busy threads": (None, 0.0),
        }
        times: dict[str, list[float]] = {name: [] for name in conditions}
        refusals: list[float] = []
        load_start = os.getloadavg()
        for _ in range(args.blocks):
            for name, load in conditions.items():
                if load is None:
                    times[name] += _detect_times(model, image, args.rounds)
                    continue
                stop = threading.Event()
                threads, refused = _callers(model, image, *load, stop)
                time.sleep(0.2)  # both callers are running when the detects start
                times[name] += _detect_times(model, image, args.rounds)
                stop.set()
                for thread in threads:
                    thread.join(60)
                refusals += refused
    rows = {
        name: {"median_s": statistics.median(ts), "max_s": max(ts), "calls": len(ts)}
        for name, ts in times.items()
    }
    rows["pathological refusal"] = {
        "median_s": statistics.median(refusals) if refusals else None,
        "max_s": max(refusals) if refusals else None,
        "calls": len(refusals),
    }
    alone = rows["detect alone"]["median_s"]
    ratios = {name: rows[name]["median_s"] / alone for name in times if name != "detect alone"}
    print(f"{'row':32}{'median s':>12}{'max s':>12}{'calls':>8}")
    for name, row in rows.items():
        median = "-" if row["median_s"] is None else f"{row['median_s']:.3f}"
        worst = "-" if row["max_s"] is None else f"{row['max_s']:.3f}"
        print(f"{name:32}{median:>12}{worst:>12}{row['calls']:>8}")
    for name, ratio in ratios.items():
        print(f"{name} / alone: {ratio:.2f}")
    meta = {
        "alternatives": args.alternatives,
        "grammar_bytes": len(grammar),
        "rounds": args.rounds,
        "blocks": args.blocks,
        "load_average": [load_start, os.getloadavg()],
        "python": platform.python_version(),
        "machine": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"wrote {write_json(args.out, {'meta': meta, 'rows': rows, 'ratios': ratios})}")


if __name__ == "__main__":
    main()
