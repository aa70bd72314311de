"""Micro-benchmark of foveal.grammars with the 49,152-token SmolLM2 vocabulary.

Measures compile, commit, single-row mask fill and batched fill (64 rows), each for our wrapper and
for the raw llguidance call it wraps, on the same matcher states (walks through the valid instances
of JSONSchemaBench schemas), and reports p50/p99 and the wrapper's overhead ratio.

    python benchmarks/grammar_layer.py [--schemas 40] [--json out.json]

`--contention` measures instead what sizes the executor's thread pool: fill_masks over 8/32/64
matchers with 1 and 2 executor threads, alone and while another thread runs a busy torch matmul
loop (a stand-in for the engine's device thread running the forward), reporting fill p50/p99 and
the matmul rate kept (vs the matmul loop alone) during the fills.

    python benchmarks/grammar_layer.py --contention [--threads 1,2] [--rows 8,32,64] [--torch-threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import llguidance
import numpy as np

from foveal import grammars
from foveal.grammars.bitmask import executor, set_mask_threads
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
    """fill_masks over `rows` matchers at different states vs one raw executor call over raw llguidance
    matchers (copies of each automaton's template) advanced to the same states."""
    matchers, raw_matchers = [], []
    rng = np.random.default_rng(0)
    while len(matchers) < rows:
        schema, trajectories = cases[len(matchers) % len(cases)]
        a = grammars.compile(schema, tok, eos_token_id=EOS)
        ids = trajectories[0]
        m, raw_m = a.matcher(), a.template.deep_copy()
        for t in ids[: int(rng.integers(0, len(ids)))]:
            m.commit(t)
            raw_m.consume_token(t)
        matchers.append(m)
        raw_matchers.append(raw_m)
    bm = grammars.allocate_bitmask(rows, matchers[0].automaton.vocab_size)
    pairs = [(raw_m, i) for i, raw_m in enumerate(raw_matchers)]
    ours, raw = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        grammars.fill_masks(matchers, bm)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        executor().unsafe_compute_mask_ptr(pairs, bm.ctypes.data, bm.shape[1] * 4, rows)
        raw.append(time.perf_counter() - start)
    return {"ours": ours, "raw": raw}


def matchers_at_random_states(tok, cases, rows: int, seed: int = 0) -> list:
    """`rows` matchers spread over the cases' schemas, each part-way through a valid instance."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < rows:
        schema, trajectories = cases[len(out) % len(cases)]
        ids = trajectories[0]
        m = grammars.compile(schema, tok, eos_token_id=EOS).matcher()
        for t in ids[: int(rng.integers(0, len(ids)))]:
            m.commit(t)
        out.append(m)
    return out


class MatmulLoop:
    """A thread multiplying `size` x `size` matrices back to back: the device thread's stand-in.
    torch releases the GIL inside each product; at size 1024 one product takes tens of ms, like the
    engine's one-call graph forward, so GIL hand-offs are rare and what is left is the competition
    for cores. `rate()` is products per second since the last `mark()`."""

    def __init__(self, size: int = 1024) -> None:
        import torch

        self._a = torch.randn(size, size)
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._mark = (time.perf_counter(), 0)

    def _run(self) -> None:
        a = self._a
        while not self._stop.is_set():
            a @ a
            self._count += 1

    def __enter__(self) -> MatmulLoop:
        self._thread.start()
        time.sleep(0.2)  # warm up
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> None:
        self._mark = (time.perf_counter(), self._count)

    def rate(self) -> float:
        t0, c0 = self._mark
        return (self._count - c0) / (time.perf_counter() - t0)


def fill_window(matchers: list, bm: np.ndarray, seconds: float) -> list[float]:
    """Back-to-back fill_masks calls for `seconds` (the worst case: the engine fills once a step)."""
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        grammars.fill_masks(matchers, bm)
        times.append(time.perf_counter() - start)
    return times


def contention(
    tok, cases, rows_list: list[int], threads_list: list[int], rounds: int, size: int
) -> list[dict]:
    """Fill p50/p99 per (rows, threads), alone and beside the matmul loop, and the loop's kept rate.

    The machine is shared, so each fill window beside the loop is paired with an idle window of the
    same length right after it (the loop's solo rate then), and configurations take turns in rounds.
    """
    configs = [(r, t) for r in rows_list for t in threads_list]
    matchers = {r: matchers_at_random_states(tok, cases, r) for r in rows_list}
    masks = {r: grammars.allocate_bitmask(r, matchers[r][0].automaton.vocab_size) for r in rows_list}
    acc = {(c, load): [] for c in configs for load in ("none", "matmul")}
    rates = {c: [0.0, 0.0] for c in configs}  # loop rate summed over fill windows, idle windows
    window = 0.25
    for _ in range(rounds):
        for rows, threads in configs:
            set_mask_threads(threads)
            acc[((rows, threads), "none")] += fill_window(matchers[rows], masks[rows], window)
    with MatmulLoop(size) as loop:
        for _ in range(rounds):
            for rows, threads in configs:
                set_mask_threads(threads)
                loop.mark()
                acc[((rows, threads), "matmul")] += fill_window(matchers[rows], masks[rows], window)
                rates[(rows, threads)][0] += loop.rate()
                loop.mark()
                time.sleep(window)
                rates[(rows, threads)][1] += loop.rate()
    set_mask_threads(None)
    out = []
    for (rows, threads), load in sorted(acc):
        row = {"rows": rows, "threads": threads, "load": load, "fills": acc[((rows, threads), load)]}
        if load == "matmul":
            busy, idle = rates[(rows, threads)]
            row["kept"] = busy / idle
        out.append(row)
    return out


def contention_main(args, tok, cases) -> None:
    import torch

    rows_list = [int(x) for x in args.rows.split(",")]
    threads_list = [int(x) for x in args.threads.split(",")]
    torch.set_num_threads(args.torch_threads)
    results = contention(tok, cases, rows_list, threads_list, args.rounds, args.matmul_size)
    print(
        f"fill_masks under contention: {os.cpu_count()} cores, {args.matmul_size}^2 matmul thread with "
        f"torch threads {torch.get_num_threads()}, {len(cases)} schemas, {args.rounds} rounds of 0.25 s windows"
    )
    print(f"{'rows':>5}{'threads':>8}{'load':>8}{'fills':>7}{'p50 µs':>10}{'p99 µs':>10}{'matmul kept':>13}")
    report = []
    for r in results:
        p50, p99 = pct(r["fills"], 50) * 1e6, pct(r["fills"], 99) * 1e6
        kept = f"{r['kept']:.2f}" if "kept" in r else "-"
        n = len(r["fills"])
        print(f"{r['rows']:>5}{r['threads']:>8}{r['load']:>8}{n:>7}{p50:>10.1f}{p99:>10.1f}{kept:>13}")
        report.append(
            {k: v for k, v in r.items() if k != "fills"} | {"fills": n, "p50_us": p50, "p99_us": p99}
        )
    Path(args.json).write_text(json.dumps({"contention": report}, indent=1))
    print(f"wrote {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schemas", type=int, default=40)
    parser.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "foveal_grammar_layer.json"))
    parser.add_argument("--contention", action="store_true", help="executor threads vs a busy matmul thread")
    parser.add_argument("--rows", default="8,32,64")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--torch-threads", type=int, default=2, help="intra-op threads of the matmul loop")
    parser.add_argument("--matmul-size", type=int, default=1024)
    args = parser.parse_args()
    tok = load_tokenizer()
    cases = load_cases(tok, args.schemas)
    if args.contention:
        contention_main(args, tok, cases)
        return
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
