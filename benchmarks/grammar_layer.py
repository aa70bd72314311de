"""Micro-benchmark of foveal.grammars with the 49,152-token SmolLM2 vocabulary.

Measures compile, commit, single-row mask fill and batched fill (64 rows), each for our wrapper and
for the raw llguidance call it wraps, on the same matcher states (walks through the valid instances
of JSONSchemaBench schemas), and reports p50/p99 and the wrapper's overhead ratio.

    python benchmarks/grammar_layer.py [--schemas 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import llguidance
import numpy as np

from foveal import grammars
from foveal.grammars.bitmask import executor
from foveal.grammars.compiler import AUTOMATA
from foveal.grammars.conformance.bench import files
from foveal.grammars.conformance.feed import EOS, load_tokenizer, serializations


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def load_cases(tok, n: int) -> list[tuple[dict, list[list[int]]]]:
    """(schema, token trajectories of its valid instances) for the first n compilable schemas."""
    out = []
    for path in files("Github_medium") + files("Github_easy"):
        doc = json.loads(path.read_text())
        try:
            a = grammars.compile(doc["schema"], tok, eos_token_id=EOS)
        except grammars.SchemaError:
            continue
        trajectories = []
        for test in doc.get("tests", []):
            if not test["valid"]:
                continue
            for text in serializations(test["data"], doc["schema"]):
                ids = tok.encode(text, add_special_tokens=False).ids
                m = a.matcher()
                try:
                    for t in ids:
                        m.commit(t)
                except grammars.GrammarViolation:
                    continue
                trajectories.append(ids)
                break
        if trajectories:
            out.append((doc["schema"], trajectories))
        if len(out) >= n:
            break
    return out


def bench_compile(tok, cases) -> dict:
    ours, raw = [], []
    handle = grammars.compile(grammars.Regex("x"), tok, eos_token_id=EOS).tokenizer
    for schema, _ in cases:
        AUTOMATA.clear()
        start = time.perf_counter()
        grammars.compile(schema, tok, eos_token_id=EOS)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=grammars.specs.JSON_OPTIONS)
        llguidance.LLMatcher(handle.ll, g, log_level=0)
        raw.append(time.perf_counter() - start)
    return {"ours": ours, "raw": raw}


def bench_steps(tok, cases) -> dict:
    """Per token: our commit and fill_mask vs llguidance's consume_token and mask fill, same states."""
    res = {"commit_ours": [], "commit_raw": [], "mask_ours": [], "mask_raw": []}
    for schema, trajectories in cases:
        a = grammars.compile(schema, tok, eos_token_id=EOS)
        bm = grammars.allocate_bitmask(1, a.vocab_size)
        raw_bm = np.zeros_like(bm)
        for ids in trajectories:
            ours = a.matcher()
            raw = a.template.deep_copy()
            for i, t in enumerate(ids):
                order = (0, 1) if i % 2 else (1, 0)  # alternate who goes first
                for who in order:
                    start = time.perf_counter()
                    if who == 0:
                        ours.fill_mask(bm, 0)
                        res["mask_ours"].append(time.perf_counter() - start)
                    else:
                        raw.unsafe_compute_mask_ptr(raw_bm.ctypes.data, raw_bm.nbytes)
                        res["mask_raw"].append(time.perf_counter() - start)
                start = time.perf_counter()
                ours.commit(t)
                res["commit_ours"].append(time.perf_counter() - start)
                start = time.perf_counter()
                raw.consume_token(t)
                res["commit_raw"].append(time.perf_counter() - start)
    return res


def bench_batch(tok, cases, rows: int = 64, repeats: int = 200) -> dict:
    """fill_masks over `rows` matchers at different states vs one raw executor call."""
    matchers = []
    rng = np.random.default_rng(0)
    while len(matchers) < rows:
        schema, trajectories = cases[len(matchers) % len(cases)]
        a = grammars.compile(schema, tok, eos_token_id=EOS)
        ids = trajectories[0]
        m = a.matcher()
        for t in ids[: int(rng.integers(0, len(ids)))]:
            m.commit(t)
        matchers.append(m)
    bm = grammars.allocate_bitmask(rows, matchers[0].automaton.vocab_size)
    pairs = [(m._ll, i) for i, m in enumerate(matchers)]
    ours, raw = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        grammars.fill_masks(matchers, bm)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        executor().unsafe_compute_mask_ptr(pairs, bm.ctypes.data, bm.shape[1] * 4, rows)
        raw.append(time.perf_counter() - start)
    return {"ours": ours, "raw": raw}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schemas", type=int, default=40)
    parser.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "foveal_grammar_layer.json"))
    args = parser.parse_args()
    tok = load_tokenizer()
    cases = load_cases(tok, args.schemas)
    steps = bench_steps(tok, cases)
    comp = bench_compile(tok, cases)
    batch = bench_batch(tok, cases)
    rows = [
        ("compile (ms)", comp["ours"], comp["raw"], 1e3),
        ("commit (µs)", steps["commit_ours"], steps["commit_raw"], 1e6),
        ("mask fill, 1 row (µs)", steps["mask_ours"], steps["mask_raw"], 1e6),
        ("fill_masks, 64 rows (µs)", batch["ours"], batch["raw"], 1e6),
    ]
    print(
        f"grammar layer, SmolLM2 vocabulary (49,152), {len(cases)} JSONSchemaBench schemas, "
        f"{len(steps['mask_ours'])} token steps"
    )
    print(f"{'':<26}{'ours p50':>10}{'ours p99':>10}{'raw p50':>10}{'raw p99':>10}{'p50 ratio':>11}")
    report = {"schemas": len(cases), "steps": len(steps["mask_ours"])}
    for name, ours, raw, scale in rows:
        o50, o99, r50, r99 = (
            pct(ours, 50) * scale,
            pct(ours, 99) * scale,
            pct(raw, 50) * scale,
            pct(raw, 99) * scale,
        )
        print(f"{name:<26}{o50:>10.2f}{o99:>10.2f}{r50:>10.2f}{r99:>10.2f}{o50 / r50:>10.2f}x")
        report[name] = {
            "ours_p50": o50,
            "ours_p99": o99,
            "raw_p50": r50,
            "raw_p99": r99,
            "ratio_p50": o50 / r50,
        }
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
