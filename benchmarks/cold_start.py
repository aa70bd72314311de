"""A fresh process's first calls: foveal and llama.cpp on the same GGUF, each in new processes, taking turns.

    python -m benchmarks.cold_start [--threads 2] [--rounds 2] [--free-tokens 96] [--steady 3]
                                    [--gguf PATH] [--contenders foveal,llama.cpp] [--importtime]
                                    [--out out/benchmarks/cold_start.json]

A script, a notebook, a CLI run or a just-started server replica lives in its first calls. Each
round starts one fresh Python process per contender (foveal, then llama.cpp), and each process, from
its first line:
  - imports its library (`import foveal` / `import llama_cpp`) and loads the file (`foveal.load(path)`
    with its engine / `llama_cpp.Llama(model_path=path)`): `import_s`, `load_s` (imports included),
    and for foveal `load_cpu_s`, the process's CPU time (every thread) in `foveal.load`, which other
    jobs on the machine change far less than the wall time;
  - makes one JSON-schema call (benchmarks.peers' "invent a character" ask and schema; llama.cpp's
    grammar built from the schema inside the call, as foveal compiles its own): `json_s`;
  - makes three free-text calls of `--free-tokens` tokens (benchmarks.llamacpp's asks): the first
    three calls' tokens/s, then `--steady` more calls of the same asks: the steady tokens/s.
Each process also reports its peak resident memory (`max_rss_mb`, getrusage).
Rows: load + first JSON call + first free-text call (`cold_s`), and foveal's over llama.cpp's
(target <= 2); the first three free calls' tokens/s over the steady ones (target >= 0.8); the load
(target <= 2 s on a quiet machine).

foveal's load reads the file's prepared weights from its weight cache (engine/models/weight_cache.py)
when an earlier load wrote them; the parent's throwaway load (the prompts) writes that entry, so
`foveal` processes load from it, as every load after a user's first does. Two more contenders can
be named in `--contenders`: `foveal-nocache` (`FOVEAL_WEIGHT_CACHE=0`: the weights prepared from
the file) and `foveal-firstload` (an empty cache folder: a file's first load, which prepares the
weights and writes the entry). Both get the same prompt token ids (the chat template foveal's
skills build, computed once by this parent process), greedy, the same threads. `--importtime`
adds a foveal process run under `python -X importtime` and lists the imports a GGUF load
triggers by their cumulative time. The report records the machine's load average at each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONTENDERS = ("foveal", "llama.cpp")
# foveal's contenders: the environment of their processes (FIRST_LOAD: an empty weight cache folder)
FIRST_LOAD = "<an empty folder>"
FOVEAL_ENV = {
    "foveal": {},
    "foveal-nocache": {"FOVEAL_WEIGHT_CACHE": "0"},
    "foveal-firstload": {"FOVEAL_CACHE": FIRST_LOAD},
}


# ---- the child processes: everything timed from their first line --------------------------------------------


def child(contender: str, spec: dict) -> dict:
    """One fresh process's load and first calls; `spec`: path, threads, prompts, token budgets."""
    start = time.perf_counter()
    out = _foveal_child(spec, start) if contender in FOVEAL_ENV else _llama_child(spec, start)
    out["load_average"] = os.getloadavg()
    return out


def _foveal_child(spec: dict, start: float) -> dict:
    import resource

    import torch

    import foveal

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    imported = time.perf_counter()
    torch.set_num_threads(spec["threads"])
    cpu_before = cpu_s()
    model = foveal.load(spec["path"], device="cpu", max_batch_size=32, max_model_len=512)
    loaded, load_cpu_s = time.perf_counter(), cpu_s() - cpu_before
    from benchmarks import peers

    work = peers.json_workload(1)

    def call(ask: str, output_type: Any, max_tokens: int) -> tuple[float, int, str]:
        model.engine.reset_stats()
        begin = time.perf_counter()
        text = model.generate(None, ask, output_type, {"temperature": 0.0, "max_tokens": max_tokens})["text"]
        return time.perf_counter() - begin, model.engine.stats()["tokens"], text

    try:
        json_s, _, json_text = call(work.asks[0], work.foveal_type, work.max_tokens)
        free = [call(ask, None, spec["free_tokens"]) for ask in spec["free_asks"]]
    finally:
        model.close()
    report = _report(imported - start, loaded - start, json_s, json_text, free, len(spec["free_asks"]) // 2)
    return {**report, "load_cpu_s": load_cpu_s, "runner": model.runner}


def _llama_child(spec: dict, start: float) -> dict:
    import llama_cpp

    imported = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=spec["path"],
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        n_ctx=1024,
        seed=0,
        verbose=False,
    )
    loaded = time.perf_counter()

    def call(ids: list[int], schema: dict | None, max_tokens: int) -> tuple[float, int, str]:
        begin = time.perf_counter()
        grammar = None if schema is None else llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
        out = llm.create_completion(ids, max_tokens=max_tokens, temperature=0.0, grammar=grammar)
        return time.perf_counter() - begin, out["usage"]["completion_tokens"], out["choices"][0]["text"]

    json_s, _, json_text = call(spec["json_ids"], spec["schema"], spec["json_tokens"])
    free = [call(ids, None, spec["free_tokens"]) for ids in spec["free_ids"]]
    return _report(imported - start, loaded - start, json_s, json_text, free, len(spec["free_ids"]) // 2)


def _report(import_s: float, load_s: float, json_s: float, json_text: str, free: list, first: int) -> dict:
    import resource

    def rate(calls: list) -> float:
        return sum(tokens for _, tokens, _ in calls) / sum(seconds for seconds, _, _ in calls)

    return {
        "import_s": import_s,
        "load_s": load_s,
        "json_s": json_s,
        "json_text": json_text[:160],
        "free_s": [seconds for seconds, _, _ in free],
        "free_tokens": [tokens for _, tokens, _ in free],
        "first_free_s": free[0][0],
        "cold_s": load_s + json_s + free[0][0],
        "first_tokens_per_s": rate(free[:first]),
        "steady_tokens_per_s": rate(free[first:]),
        # the process's peak resident memory (Linux reports KiB): weights, K/V, library, interpreter
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# ---- the parent: prompts, fresh processes taking turns, rows --------------------------------------------------


def prompts(path: str, free_asks: list[str]) -> dict:
    """The token ids both contenders get: foveal's chat template over the asks (a throwaway load)."""
    import foveal
    from benchmarks import peers

    work = peers.json_workload(1)
    with foveal.load(path, device="cpu", max_model_len=512) as model:
        ids = [model.family.encode(model.family.query(a), [], None)[0].token_ids for a in [*work.asks, *free_asks]]
    return {"json_ids": ids[0], "free_ids": ids[1:], "schema": peers.PERSON_SCHEMA, "json_tokens": work.max_tokens}


def spawn(contender: str, spec: dict, importtime: bool = False) -> dict:
    """Run `child(contender, spec)` in a fresh interpreter; its report (and -X importtime's lines)."""
    with tempfile.TemporaryDirectory() as folder:
        spec_path, out_path = Path(folder) / "spec.json", Path(folder) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, *(["-X", "importtime"] if importtime else [])]
        cmd += ["-m", "benchmarks.cold_start", "--child", contender, str(spec_path), str(out_path)]
        extra = FOVEAL_ENV.get(contender, {})
        env = {**os.environ, **{k: str(Path(folder) / "cache") if v == FIRST_LOAD else v for k, v in extra.items()}}
        root = Path(__file__).resolve().parents[1]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"the {contender} process failed: {done.stderr.strip()[-2000:]}")
        report = json.loads(out_path.read_text())
    if importtime:
        report["imports"] = top_imports(done.stderr)
    return report


def top_imports(stderr: str, count: int = 12) -> list[dict]:
    """The slowest top-level imports of `python -X importtime`'s lines, by cumulative seconds."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line[len("import time:") :].split("|")
        if cumulative.strip().isdigit() and not name[1:].startswith(" "):  # nested imports are indented
            rows.append({"module": name.strip(), "cumulative_s": int(cumulative) / 1e6})
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:count]


def run(
    threads: int = 2,
    rounds: int = 2,
    free_tokens: int = 96,
    steady: int = 3,
    gguf: str | None = None,
    contenders: tuple[str, ...] = CONTENDERS,
    importtime: bool = False,
) -> dict:
    from benchmarks.llamacpp import FREE_ASKS
    from foveal.testing.smollm2 import smollm2_gguf

    unknown = [c for c in contenders if c not in FOVEAL_ENV and c != "llama.cpp"]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {', '.join([*FOVEAL_ENV, 'llama.cpp'])}")
    path = str(gguf or smollm2_gguf())
    asks = (FREE_ASKS * 2)[:3]
    free_asks = asks + (asks * steady)[:steady]
    spec = {"path": path, "threads": threads, "free_tokens": free_tokens, "free_asks": free_asks}
    spec.update(prompts(path, free_asks))
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    for _ in range(rounds):
        for contender in contenders:  # taking turns, so each pair of processes meets the same load
            runs[contender].append(spawn(contender, spec))
    report: dict[str, Any] = {
        "model": path,
        "threads": threads,
        "free_tokens": free_tokens,
        "machine": {"cpus": os.cpu_count(), "load_average_end": os.getloadavg()},
        "runs": runs,
        "rows": [row(c, runs[c]) for c in contenders],
    }
    if importtime and "foveal" in contenders:
        report["foveal_imports"] = spawn("foveal", spec, importtime=True)["imports"]
    report["ratios"] = ratios(report["rows"])
    return report


def row(contender: str, runs: list[dict]) -> dict:
    """A contender's medians over its fresh processes (the lower middle one of an even count)."""

    def median(key: str) -> float:
        values = sorted(r[key] for r in runs)
        return values[(len(values) - 1) // 2]

    keys = ("import_s", "load_s", "json_s", "first_free_s", "cold_s", "first_tokens_per_s", "steady_tokens_per_s")
    keys += ("load_cpu_s",) if all("load_cpu_s" in r for r in runs) else ()
    keys += ("max_rss_mb",) if all("max_rss_mb" in r for r in runs) else ()
    out = {"contender": contender, "processes": len(runs), **{key: median(key) for key in keys}}
    out["first_vs_steady"] = out["first_tokens_per_s"] / out["steady_tokens_per_s"]
    out["load_averages"] = [r["load_average"][0] for r in runs]
    if "runner" in runs[0]:
        out["runner"] = runs[0]["runner"]
    return out


def ratios(rows: list[dict]) -> dict:
    by = {r["contender"]: r for r in rows}
    out = {f"{name}_first_three_vs_steady": r["first_vs_steady"] for name, r in by.items()}
    for name in FOVEAL_ENV:
        if name in by and "llama.cpp" in by:
            prefix = "" if name == "foveal" else f"{name}_"
            out[f"{prefix}cold_s_vs_llamacpp"] = by[name]["cold_s"] / by["llama.cpp"]["cold_s"]
            out[f"{prefix}load_s_vs_llamacpp"] = by[name]["load_s"] / by["llama.cpp"]["load_s"]
    return out


def print_table(report: dict) -> None:
    print(
        f"fresh processes on {Path(report['model']).name}, {report['threads']} thread(s), "
        f"{report['free_tokens']} free-text tokens a call; medians of {report['rows'][0]['processes']} process(es)"
    )
    print(
        f"  {'contender':<16} {'import':>7} {'load':>7} {'1st JSON':>9} {'1st free':>9} {'cold':>7}"
        f" {'3 first':>8} {'steady':>8} {'ratio':>6}  load avg"
    )
    for r in report["rows"]:
        print(
            f"  {r['contender']:<16} {r['import_s']:6.2f}s {r['load_s']:6.2f}s {r['json_s']:8.2f}s {r['first_free_s']:8.2f}s"
            f" {r['cold_s']:6.2f}s {r['first_tokens_per_s']:5.1f}t/s {r['steady_tokens_per_s']:5.1f}t/s"
            f" {r['first_vs_steady']:6.2f}  {', '.join(f'{x:.1f}' for x in r['load_averages'])}"
        )
    for r in report["rows"]:
        if "max_rss_mb" in r:
            print(f"  {r['contender']}: peak resident memory {r['max_rss_mb']:.0f} MB (median)")
        if "runner" in r:
            print(f"  {r['contender']}: runner {r['runner']}")
    for r in report["rows"]:
        if "load_cpu_s" in r:
            print(f"  {r['contender']}: CPU time in foveal.load {r['load_cpu_s']:.2f} s (every thread, median)")
    for r in report.get("foveal_imports", []):
        print(f"  import {r['module']:<28} {r['cumulative_s']:6.2f} s (cumulative, foveal's process)")
    print("  ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in report["ratios"].items()))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        contender, spec_path, out_path = argv[1:4]
        Path(out_path).write_text(json.dumps(child(contender, json.loads(Path(spec_path).read_text()))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per contender, taking turns")
    parser.add_argument("--free-tokens", type=int, default=96)
    parser.add_argument("--steady", type=int, default=3, help="free-text calls after the first three")
    parser.add_argument("--gguf", help="a llama GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--importtime", action="store_true", help="list the imports of foveal's load")
    parser.add_argument("--out", default="out/benchmarks/cold_start.json")
    args = parser.parse_args(argv)
    report = run(
        args.threads,
        args.rounds,
        args.free_tokens,
        args.steady,
        args.gguf,
        tuple(c for c in args.contenders.split(",") if c),
        args.importtime,
    )
    print_table(report)
    from benchmarks import write_json

    print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
