"""Noisy neighbour (issue 13): what one expensive grammar costs every other request's mask step.

The engine fills the masks of a whole step in one native call (`grammars.fill_masks`), so a row
whose mask is slow delays every row. This times that call for 8 ordinary rows (a small JSON schema)
alone, beside 4 rows of `a{100000}` (compiled straight through llguidance, as foveal did before
grammars/limits.py refused it), and beside 4 rows of the longest forced run foveal now accepts.

    python -m benchmarks.noisy_neighbour [--tokenizer DIR] [--steps 30] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import llguidance
import numpy as np
from tokenizers import Tokenizer

from foveal import grammars
from foveal.grammars.limits import MAX_FORCED_BYTES

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=SHARED_TOKENIZER)
    parser.add_argument("--steps", type=int, default=30)
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
    if args.out:
        args.out.write_text(json.dumps({"fill_masks_ms": results, "a100000": verdict}, indent=2))


if __name__ == "__main__":
    main()
