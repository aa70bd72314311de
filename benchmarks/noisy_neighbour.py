"""Noisy neighbour (issue 13): what one expensive grammar costs every other request's mask step.

The engine fills the masks of a whole step in one native call (`grammars.fill_masks`), so a row
whose mask is slow delays every row. This times that call for 8 ordinary rows (a small JSON schema)
alone, beside 4 rows of `a{100000}` (compiled straight through llguidance, as foveal did before
grammars/limits.py refused it), and beside 4 rows of the longest forced run foveal now accepts.

Then the same question at the SDK, as a user sees it: the latency of `detect` on the embedded model
(`foveal.load()`), one caller alone, and the same caller while 4 threads keep calling
`generate(img, prompt, Regex('a{2048}'))` (MAX_FORCED_BYTES: the longest forced run compile
accepts). Issue 13's "before": 30 ms alone, 786 ms beside four `a{100000}` calls (now refused).

    python -m benchmarks.noisy_neighbour [--tokenizer DIR] [--steps 30] [--calls 20] [--out FILE.json]

`--calls 0` skips the SDK measurement (it loads the model: ~10 s, then about calls x 0.1 s alone
and calls x (detect latency beside the neighbours)).
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from pathlib import Path

import llguidance
import numpy as np
from tokenizers import Tokenizer

import foveal
from benchmarks import write_json
from foveal import grammars
from foveal.grammars.limits import MAX_FORCED_BYTES
from foveal.vision import scenes

SHARED_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "smollm2"
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "label": {"type": "string"}},
    "required": ["x", "y", "label"],
}


class Unchecked(grammars.Matcher):
    """A matcher over a raw llguidance template: the spec foveal refuses, as it ran before."""


def unchecked_matchers(pattern: str, automaton: grammars.Automaton, n: int) -> list[grammars.Matcher]:
    template = llguidance.LLMatcher(
        automaton.tokenizer.ll, llguidance.LLMatcher.grammar_from_regex(pattern), log_level=0
    )
    return [Unchecked(automaton, template.deep_copy()) for _ in range(n)]


def step_times(rows: list[grammars.Matcher], steps: int, rng: np.random.Generator) -> np.ndarray:
    """Seconds per `fill_masks` call; every row then commits a token its mask allows."""
    bitmask = grammars.allocate_bitmask(len(rows), rows[0].automaton.vocab_size)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        grammars.fill_masks(rows, bitmask)
        times.append(time.perf_counter() - start)
        for row, m in enumerate(rows):
            bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits)
            if m.is_terminated() or not len(allowed):
                continue
            m.commit(int(rng.choice(allowed)))
    return np.asarray(times)


def detect_ms(model: foveal.Model, image: object, calls: int) -> np.ndarray:
    """Milliseconds of each of `calls` sequential greedy detect calls."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        model.detect(image, "circle")
        times.append(time.perf_counter() - start)
    return np.asarray(times) * 1e3


def detect_beside(
    model: foveal.Model, image: object, calls: int, spec: object, n: int
) -> tuple[np.ndarray, dict]:
    """Detect latencies while `n` threads keep one `generate(image, ..., spec)` each in flight; also
    how their calls ended (a forced run longer than the context ends in IncompleteOutputError)."""
    stop = threading.Event()
    ended: dict[str, int] = {}
    lock = threading.Lock()

    def neighbour() -> None:
        while not stop.is_set():
            try:
                model.generate(image, "write the letter a", output_type=spec)
                outcome = "returned"
            except foveal.IncompleteOutputError:
                outcome = "IncompleteOutputError (max_tokens)"
            with lock:
                ended[outcome] = ended.get(outcome, 0) + 1

    threads = [threading.Thread(target=neighbour, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # every neighbour is decoding (its prefill is one step of ~10 ms)
    try:
        times = detect_ms(model, image, calls)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    return times, ended


def sdk_latency(calls: int) -> dict:
    """Detect latency on the embedded model alone, beside 4 callers of the longest forced run, and
    beside 4 callers of a free run of the same length (`[ab]{N}`: the same rows and tokens, a cheap
    mask), which separates what the forced grammar costs from what 4 more rows in each step cost."""
    heaviest = grammars.Regex(f"a{{{MAX_FORCED_BYTES}}}")
    control = grammars.Regex(f"[ab]{{{MAX_FORCED_BYTES}}}")
    image = scenes.render(scenes.generate_scene(3, 64))
    results: dict = {}
    with foveal.load() as model:
        detect_ms(model, image, 5)  # warm: traces, the image encoding cache
        with contextlib.suppress(foveal.IncompleteOutputError):  # warm the forced run's grammar too
            model.generate(image, "write the letter a", output_type=heaviest)
        cases = {
            "detect alone": lambda: (detect_ms(model, image, calls), {}),
            f"detect beside 4 generate(Regex('a{{{MAX_FORCED_BYTES}}}'))": lambda: detect_beside(
                model, image, calls, heaviest, 4
            ),
            f"detect beside 4 generate(Regex('[ab]{{{MAX_FORCED_BYTES}}}'))": lambda: detect_beside(
                model, image, calls, control, 4
            ),
        }
        print(f"\nSDK, embedded model, {calls} detect calls each")
        print(f"{'case':48s} {'p50 ms':>8s} {'p90 ms':>8s} {'max ms':>8s}")
        for name, run in cases.items():
            times, ended = run()
            row = {q: float(np.percentile(times, p)) for q, p in (("p50", 50), ("p90", 90), ("max", 100))}
            results[name] = {**row, "calls": calls, "neighbour_calls": ended}
            print(f"{name:48s} {row['p50']:8.1f} {row['p90']:8.1f} {row['max']:8.1f}")
            if ended:
                print(f"  neighbour calls ended: {ended}")
        assert model.engine.wait_idle(30) and model.engine.free_pages() == model.engine.config.num_pages
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=SHARED_TOKENIZER)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--calls", type=int, default=20, help="detect calls per SDK case (0: skip the SDK part)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    ordinary = grammars.compile(SCHEMA, tok, eos_token_id=EOS)
    heaviest = grammars.compile(grammars.Regex(f"a{{{MAX_FORCED_BYTES}}}"), tok, eos_token_id=EOS)
    try:
        grammars.compile(grammars.Regex("a{100000}"), tok, eos_token_id=EOS)
        verdict = "accepted"
    except grammars.SchemaError as err:
        verdict = f"refused: {str(err)[:90]}..."
    cases = {
        "8 ordinary rows": lambda: [ordinary.matcher() for _ in range(8)],
        "8 ordinary + 4 a{100000} (before)": lambda: (
            [ordinary.matcher() for _ in range(8)] + unchecked_matchers("a{100000}", ordinary, 4)
        ),
        f"8 ordinary + 4 a{{{MAX_FORCED_BYTES}}} (now the max)": lambda: (
            [ordinary.matcher() for _ in range(8)] + [heaviest.matcher() for _ in range(4)]
        ),
    }
    results = {}
    print(f"{'batch':42s} {'p50 ms':>8s} {'p90 ms':>8s} {'max ms':>8s}")
    for name, rows in cases.items():
        times = step_times(rows(), args.steps, np.random.default_rng(0)) * 1e3
        results[name] = {
            q: float(np.percentile(times, p)) for q, p in (("p50", 50), ("p90", 90), ("max", 100))
        }
        r = results[name]
        print(f"{name:42s} {r['p50']:8.2f} {r['p90']:8.2f} {r['max']:8.2f}")
    print(f"compile(Regex('a{{100000}}')) now: {verdict}")
    report = {"fill_masks_ms": results, "a100000": verdict}
    if args.calls:
        report["sdk_detect_ms"] = sdk_latency(args.calls)
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
