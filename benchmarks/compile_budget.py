"""Compile budget: what refusing a pathological grammar costs, what a normal compile costs, and what
compiles running in other threads do to a small one (grammars/limits.py, grammars/cache.py).

Rows, each the median (and max) of --rounds compiles with the SmolLM2 tokenizer:
- refuse 60,000 alternatives: `start: "a0" | ... | "a59999"` (649 KB); before the budget llguidance
  spent seconds building it, then refused it (its Earley row is too wide);
- refuse 100,000 literals: the same with 100,000 (1.1 MB; llguidance panicked on it);
- heaviest admitted: 9,900 literal alternatives, a JSON schema of 1,200 optional properties and one
  of 1,600 bounded integers, each just inside the default budget (the most expensive Lark and JSON
  shapes found per symbol and per unit of lexer fuel), compiled fresh each round;
- GIL wait: how long a thread sleeping 1 ms at a time overruns while a heaviest compile runs on
  another thread (near zero: the compile leaves the GIL free);
- normal JSON schema / detect grammar: a detect-like JSON schema and the detect skill's spatial
  grammar (`spatial.boxes`), each compiled fresh each round (a description or max_objects varies);
- detect beside ...: the detect compile while two other threads compile back to back (a) the
  heaviest admitted grammar or schema (the longest compiles the budget lets run, llguidance holding
  no GIL), (b) the 60,000-alternative grammar, refused each time, and (c) the same
  with 10 ms between a thread's attempts, and (d) for reference, two threads running a busy loop of
  plain Python. The ratio is the detect compile's median beside the load over its median alone
  (blocks alternate, as the machine is shared). (b) is a loop of pure Python (a refusal takes well
  under a millisecond, all of it holding the GIL), so like (d) it measures CPython's GIL hand-off
  (a waiting thread gets the GIL back after the 5 ms switch interval), not the compile.

    python -m benchmarks.compile_budget [--rounds 20] [--json FILE] [--corpus]

`--corpus` measures every real grammar of ../shared/conformance (JSON-Schema-Test-Suite and
JSONSchemaBench schemas, outlines-core cases, llguidance's and outlines' Lark and GBNF grammars)
against the default budget: the largest text size and item count seen, the symbols and lexer fuel
of the largest (by bisection over llguidance's limits), the slowest compile, and how many grammars
the budget refuses (it must refuse none). It takes about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import llguidance

from benchmarks import write_json
from foveal import grammars
from foveal.grammars import spatial
from foveal.grammars.automaton import DECODE_LIMITS, compile_template
from foveal.grammars.conformance.feed import CONFORMANCE, EOS, load_tokenizer
from foveal.grammars.limits import CompileBudget, compile_budget
from foveal.grammars.specs import grammar_source
from foveal.grammars.tokenizer import tokenizer_handle

HEAVIEST_ADMITTED = 9_900  # literal alternatives: ~9,900 symbols and 19,800 items, inside the default budget
HEAVIEST_SCHEMA = 1_200  # optional properties of one object: the most the default max_symbols admits
HEAVIEST_NUMBERS = 1_600  # required bounded integers: near the most the default max_lexer_fuel admits


def alternatives(n: int, prefix: str = "") -> grammars.CFG:
    """`start: "a0" | "a1" | ... `: n literal alternatives (a fresh `prefix` makes a fresh cache key)."""
    body = " | ".join(f'"a{i}"' for i in range(n))
    return grammars.CFG(f'start: "{prefix}" ({body})' if prefix else f"start: {body}")


def many_properties(n: int, variant: int) -> dict:
    """One object of n optional string properties: llguidance's costliest JSON shape found per symbol."""
    properties = {f"p{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "description": f"variant {variant}", "properties": properties}


def bounded_integers(n: int, variant: int) -> dict:
    """One object of n required integers, each with its own bounds: a range regex apiece (lexer fuel)."""
    properties = {f"p{i}": {"type": "integer", "minimum": -37 * i, "maximum": 1013 * i + 7} for i in range(n)}
    return {
        "type": "object",
        "description": f"variant {variant}",
        "properties": properties,
        "required": list(properties),
    }


def detect_schema(variant: int) -> dict:
    box = {k: {"type": "number", "minimum": 0, "maximum": 1} for k in ("x_min", "y_min", "x_max", "y_max")}
    return {
        "type": "object",
        "description": f"variant {variant}",
        "properties": {"objects": {"type": "array", "items": {"type": "object", "properties": box}}},
        "required": ["objects"],
    }


def timed(compile_once: Callable[[], Any]) -> float:
    """Seconds one compile (or refusal) takes."""
    start = time.perf_counter()
    with contextlib.suppress(grammars.SchemaError):
        compile_once()
    return time.perf_counter() - start


def ms(values: list[float]) -> dict:
    return {"median_ms": statistics.median(values) * 1e3, "max_ms": max(values) * 1e3, "n": len(values)}


def refusal_of(spec: Any, tok: Any) -> str:
    try:
        grammars.compile(spec, tok, eos_token_id=EOS)
    except grammars.SchemaError as error:
        return f"SchemaError (limit {error.limit}): {str(error)[:90]}..."
    return "compiled"


class Load:
    """Two threads compiling back to back (`pause` seconds between a thread's attempts)."""

    def __init__(self, compile_once: Callable[[], Any], pause: float = 0.0) -> None:
        self._compile_once, self._pause = compile_once, pause
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.compiles = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            timed(self._compile_once)
            self.compiles += 1
            if self._pause:
                time.sleep(self._pause)

    def __enter__(self) -> Load:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]
        for thread in self._threads:
            thread.start()
        time.sleep(0.05)  # both threads inside their first compile
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def gil_waits(compile_once: Callable[[], Any]) -> dict:
    """How long a thread that sleeps 1 ms at a time waits past its 1 ms while `compile_once` runs on
    another thread: the time it waits for the GIL (and a core). Near zero: the compile holds no GIL."""
    waits: list[float] = []
    worker = threading.Thread(target=timed, args=(compile_once,))
    worker.start()
    while worker.is_alive():
        start = time.perf_counter()
        time.sleep(0.001)
        waits.append(time.perf_counter() - start - 0.001)
    worker.join()
    return {"median_ms": statistics.median(waits) * 1e3, "max_ms": max(waits) * 1e3, "n": len(waits)}


def contention(detect_once: Callable[[], Any], loads: dict[str, Load], rounds: int) -> dict:
    """The detect compile alone and beside each load, in alternating blocks of rounds // 2."""
    alone: list[float] = []
    beside: dict[str, list[float]] = {name: [] for name in loads}
    for _ in range(2):
        alone += [timed(detect_once) for _ in range(rounds // 2)]
        for name, load in loads.items():
            with load:
                beside[name] += [timed(detect_once) for _ in range(rounds // 2)]
    base = statistics.median(alone)
    out = {"alone": ms(alone)}
    for name, times in beside.items():
        out[name] = ms(times) | {
            "ratio": statistics.median(times) / base,
            "load_compiles": loads[name].compiles,
        }
    return out


def main_rows(tok: Any, rounds: int) -> dict:
    fresh = itertools.count()
    big, bigger = alternatives(60_000), alternatives(100_000)
    grammars.compile(grammars.Regex("warm"), tok, eos_token_id=EOS)  # the tokenizer handle, built once
    report: dict[str, Any] = {"budget": repr(compile_budget())}
    report["refuse 60,000 alternatives"] = ms(
        [timed(lambda: grammars.compile(big, tok, eos_token_id=EOS)) for _ in range(rounds)]
    ) | {"bytes": len(big.definition), "verdict": refusal_of(big, tok)}
    report["refuse 100,000 literals"] = ms(
        [timed(lambda: grammars.compile(bigger, tok, eos_token_id=EOS)) for _ in range(rounds)]
    ) | {"bytes": len(bigger.definition), "verdict": refusal_of(bigger, tok)}

    def heaviest() -> Any:
        return grammars.compile(alternatives(HEAVIEST_ADMITTED, f"v{next(fresh)}"), tok, eos_token_id=EOS)

    def heaviest_schema() -> Any:
        return grammars.compile(many_properties(HEAVIEST_SCHEMA, next(fresh)), tok, eos_token_id=EOS)

    report[f"heaviest admitted ({HEAVIEST_ADMITTED:,} alternatives)"] = ms(
        [timed(heaviest) for _ in range(max(3, rounds // 5))]
    )

    def heaviest_numbers() -> Any:
        return grammars.compile(bounded_integers(HEAVIEST_NUMBERS, next(fresh)), tok, eos_token_id=EOS)

    report[f"heaviest admitted ({HEAVIEST_SCHEMA:,} properties)"] = ms(
        [timed(heaviest_schema) for _ in range(max(3, rounds // 5))]
    ) | {"verdict": refusal_of(many_properties(HEAVIEST_SCHEMA, -1), tok)}
    report[f"heaviest admitted ({HEAVIEST_NUMBERS:,} bounded integers)"] = ms(
        [timed(heaviest_numbers) for _ in range(max(3, rounds // 5))]
    ) | {"verdict": refusal_of(bounded_integers(HEAVIEST_NUMBERS, -1), tok)}

    for name, compile_once in (("grammar", heaviest), ("schema", heaviest_numbers)):
        report[f"GIL wait during heaviest {name}"] = gil_waits(compile_once)

    def schema_once() -> Any:
        return grammars.compile(detect_schema(next(fresh)), tok, eos_token_id=EOS)

    def detect_once() -> Any:
        return grammars.compile(spatial.boxes(max_objects=1 + next(fresh)), tok, eos_token_id=EOS)

    report["normal JSON schema"] = ms([timed(schema_once) for _ in range(rounds)])
    report["detect grammar"] = ms([timed(detect_once) for _ in range(rounds)])
    report["contention"] = contention(
        detect_once,
        {
            "beside 2 heaviest admitted grammars": Load(heaviest),
            "beside 2 heaviest admitted schemas": Load(heaviest_numbers),
            "beside 2 refusal loops": Load(lambda: grammars.compile(big, tok, eos_token_id=EOS)),
            "beside 2 refusal loops, 10 ms apart": Load(
                lambda: grammars.compile(big, tok, eos_token_id=EOS), pause=0.01
            ),
            "beside 2 busy Python loops (no compile)": Load(lambda: sum(range(1000))),
        },
        rounds,
    )
    return report


def print_rows(report: dict) -> None:
    print(f"compile budget: {report['budget']}, SmolLM2 tokenizer, {os.cpu_count()} cores")
    print(f"{'':<44}{'median ms':>11}{'max ms':>10}{'ratio':>8}")
    for name, row in report.items():
        if isinstance(row, dict) and "median_ms" in row:
            print(f"{name:<44}{row['median_ms']:>11.2f}{row['max_ms']:>10.2f}")
            if "verdict" in row:
                print(f"    {row['verdict']}")
    for name, row in report["contention"].items():
        ratio = f"{row['ratio']:.2f}x" if "ratio" in row else ""
        print(f"{'detect ' + name:<44}{row['median_ms']:>11.2f}{row['max_ms']:>10.2f}{ratio:>8}")


# ---- the corpora


def real_grammars() -> Iterator[tuple[str, Any]]:
    """(name, spec) of every real grammar of ../shared/conformance (module docstring)."""
    for path in sorted((CONFORMANCE / "jsonschemabench").glob("*/*.json")):
        yield f"jsonschemabench/{path.parent.name}/{path.name}", json.loads(path.read_text())["schema"]
    for path in sorted((CONFORMANCE / "jsts" / "tests").rglob("*.json")):
        for i, group in enumerate(json.loads(path.read_text())):
            yield f"jsts/{path.relative_to(CONFORMANCE / 'jsts')}#{i}", group["schema"]
    cases = CONFORMANCE / "grammars"
    lark_cases = json.loads((cases / "llguidance" / "cases" / "test_lark.rs.cases.json").read_text())
    for case in lark_cases["cases"]:
        yield f"llguidance test_lark.rs:{case['line']}", grammars.CFG(case["grammar"])
    core = json.loads((cases / "outlines-core" / "cases" / "json_schema_mod.rs.cases.json").read_text())
    for i, case in enumerate(core["cases"]):
        yield f"outlines-core json_schema_mod.rs #{i}", case["schema"]
    for path in sorted(cases.rglob("*.lark")):
        yield str(path.relative_to(cases)), grammars.CFG(path.read_text())
    for path in sorted(cases.rglob("*.gbnf")):
        yield (
            str(path.relative_to(cases)),
            grammars.CFG(llguidance.gbnf_to_lark.gbnf_to_lark(path.read_text())),
        )
    for path in sorted(cases.rglob("*.schema.json")):
        yield str(path.relative_to(cases)), json.loads(path.read_text())


def text_measures(grammar: str) -> dict:
    """What check_budget measures of a grammar text (grammars/limits.py)."""
    return {"bytes": len(grammar.encode()), "items": grammar.count("|") + grammar.count('"') // 2}


def smallest_limit(ll: Any, grammar: str, field: str, low: int, high: int) -> int:
    """The least value of a budget fuel field (max_symbols, max_lexer_fuel) the grammar compiles under."""
    while low < high:
        mid = (low + high) // 2
        limits = CompileBudget(**{field: mid}).parser_limits(**DECODE_LIMITS)
        if "too big" in llguidance.LLMatcher(ll, grammar, log_level=0, limits=limits).get_error():
            low = mid + 1
        else:
            high = mid
    return low


def corpus(tok: Any) -> dict:
    """Every real grammar against the default budget (module docstring)."""
    handle = tokenizer_handle(tok, eos_token_id=EOS)
    budget = compile_budget()
    probes = {"max_symbols": 1_000, "max_lexer_fuel": 20_000}  # most real grammars need less than these
    largest = {"bytes": (0, ""), "items": (0, ""), "max_symbols": (0, ""), "max_lexer_fuel": (0, "")}
    slowest, refused, grammars_seen, unsupported = (0.0, ""), [], 0, 0
    for name, spec in real_grammars():
        try:
            source = grammar_source(spec)
        except grammars.SchemaError:
            unsupported += 1  # refused before any grammar exists (an unsupported keyword): no cost to measure
            continue
        grammars_seen += 1
        for key, value in text_measures(source.grammar).items():
            largest[key] = max(largest[key], (value, name))
        for field, probe in probes.items():
            limits = CompileBudget(**{field: probe}).parser_limits(**DECODE_LIMITS)
            error = llguidance.LLMatcher(handle.ll, source.grammar, log_level=0, limits=limits).get_error()
            if "too big" in error:
                need = smallest_limit(handle.ll, source.grammar, field, probe, 100 * probe)
                largest[field] = max(largest[field], (need, name))
        start = time.perf_counter()
        try:
            compile_template(handle, source, budget)
        except grammars.SchemaError as error:
            if error.limit is not None or "llguidance failed inside" in str(error):
                refused.append({"grammar": name, "why": str(error)[:200]})
        slowest = max(slowest, (time.perf_counter() - start, name))
    limits = {
        "bytes": budget.max_grammar_bytes,
        "items": budget.max_items,
        "max_symbols": budget.max_symbols,
        "max_lexer_fuel": budget.max_lexer_fuel,
    }
    return {
        "grammars": grammars_seen,
        "refused_before_any_grammar": unsupported,
        "largest": {k: {"value": v, "grammar": n, "limit": limits[k]} for k, (v, n) in largest.items()},
        "slowest_compile": {"ms": slowest[0] * 1e3, "grammar": slowest[1]},
        "refused_by_budget": refused,
    }


def print_corpus(report: dict) -> None:
    print(f"\nreal grammars of {CONFORMANCE}: {report['grammars']} compiled under the default budget")
    print(f"{'measure':<16}{'largest seen':>14}{'limit':>10}{'headroom':>10}  grammar")
    for key, row in report["largest"].items():
        headroom = row["limit"] / row["value"] if row["value"] else float("inf")
        print(f"{key:<16}{row['value']:>14,}{row['limit']:>10,}{headroom:>9.1f}x  {row['grammar']}")
    slow = report["slowest_compile"]
    print(f"slowest compile: {slow['ms']:.1f} ms ({slow['grammar']})")
    print(f"refused by the budget: {len(report['refused_by_budget'])}")
    for row in report["refused_by_budget"][:10]:
        print(f"    {row['grammar']}: {row['why']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "foveal_compile_budget.json"))
    parser.add_argument("--corpus", action="store_true", help="measure every real grammar of the corpora")
    args = parser.parse_args()
    tok = load_tokenizer()
    report = main_rows(tok, args.rounds)
    print_rows(report)
    if args.corpus:
        report["corpus"] = corpus(tok)
        print_corpus(report["corpus"])
    print(f"wrote {write_json(args.json, report)}")


if __name__ == "__main__":
    main()
