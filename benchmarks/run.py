"""The whole benchmark suite in one run: one summary table, one JSON, the machine described.

    python -m benchmarks.run [--quick] [--json out/benchmarks/run.json] [--device cpu] [--threads N]
    python -m benchmarks.run --markdown out/benchmarks/run.json     # a saved run's table, for the README

Issue 8's five measurements and issue 18's sixth, in this order, all in one process so that the ratios share the
machine's load (the load average is recorded at the start and the end of each section):
  1. pipelining: foveal pipelined vs blocking at 1, 8 and 32 streams (`benchmarks.pipeline.measure`,
     greedy, EOS ignored, the same 8-token prompts) on the embedded model and on SmolLM2-135M:
     tokens/s ratio, the ideal ratio from the measured forward, sample and host times, device idle;
  2. the cost of structure: constrained / unconstrained pipelined tokens/s at 32 streams on
     SmolLM2; the grammar is a JSON array of box objects with minItems 200, so no stream can end
     early and both runs decode exactly the same number of tokens;
  3. peers (`benchmarks.peers`): 32 concurrent JSON-schema and detect requests on SmolLM2;
  4. grammar layer: foveal's matcher vs raw llguidance (`benchmarks.grammar_layer`), and compile /
     mask times vs xgrammar and outlines-core (`benchmarks.grammar_peers`);
  5. image reuse (`benchmarks.image_reuse`): repeated detect calls on one image, raw vs
     `model.encode_image` once;
  6. less work per answer (`benchmarks.less_work`): prefix cache and jump-forward against
     transformers + outlines on a shared document, one image asked for many objects, one JSON call
     at batch 1, and the 32-request workloads.
The embedded model: the shipped weights in sdk/embedded when present, else the embedded
architecture (a PaliGemma, train_shapes' default config) with untrained weights: same cost per
token, and the report says which. `--quick`: a tiny random Llama with SmolLM2's tokenizer instead
of SmolLM2, fewer streams, tokens and schemas (a smoke run of the harness, not a measurement).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import grammar_layer, grammar_peers, image_reuse, less_work, peers, pipeline, write_json
from foveal import families, grammars
from foveal.testing.smollm2 import smollm2_folder

EMBEDDED = Path(__file__).resolve().parents[1] / "sdk" / "embedded"
VERSIONS = ("torch", "transformers", "tokenizers", "llguidance", "outlines", "outlines-core", "xgrammar")
NUMBER = {"type": "number", "minimum": 0, "maximum": 1}
ENDLESS_BOXES = {  # a realistic JSON mask that cannot close within the benchmark's token budget
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {k: NUMBER for k in peers.BOX_KEYS},
        "required": list(peers.BOX_KEYS),
        "additionalProperties": False,
    },
}
# THREADS: one intra-op thread for every contender on CPU. Measured on the shared 2-core machine (load
# average ~5): a SmolLM2-sized batch-8 forward took 121 ms on 1 thread and 778 ms on 2 (intra-op
# barriers wait on preempted threads), and foveal's scheduler thread needs the other core.
TARGETS = {
    "pipelined gain / ideal": 0.9,
    "constrained / unconstrained tok/s at 32 streams": 0.95,
    "foveal / (generate + outlines), constrained": 3.0,
    "foveal / generate_batch async, unconstrained": 1.0,
}


# ---- the machine ---------------------------------------------------------------------------------------------


def machine(device: str) -> dict:
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "device": device,
        "load_average": os.getloadavg(),
        "versions": {name: version(name) for name in VERSIONS},
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ---- sections ------------------------------------------------------------------------------------------------


def embedded_folder(tmp: str) -> tuple[Path, str]:
    if (EMBEDDED / "model.safetensors").is_file():
        return EMBEDDED, "embedded (shipped weights)"
    from foveal.training import train_shapes

    folder = train_shapes.Trainer(train_shapes.TrainConfig()).export(
        Path(tmp) / "embedded", dtype=torch.float32
    )
    return folder, "embedded architecture, untrained (no weights in sdk/embedded)"


def pipelining(
    loaded: Any, label: str, streams: list[int], tokens: int, repeat: int, automaton=None
) -> list[dict]:
    """Blocking vs pipelined at each stream count (pipeline.measure: interleaved repeats, medians)."""
    rows = []
    for n in streams:
        r = pipeline.measure(None, automaton, 0.0, n, tokens, repeat, real=loaded)
        raw = r.pop("raw")  # both modes' full stats; the pipelined forward time tells contention apart
        r["pipelined_F_ms"] = raw["pipelined"]["forward_ms"]
        r["pipelined_phase_ms"] = raw["pipelined"]["phase_ms_per_step"]
        r["blocking_phase_ms"] = raw["blocking"]["phase_ms_per_step"]
        rows.append({"model": label, **r})
        print(
            f"  {label[:40]:<40} x{n:<3} {'json' if automaton else 'free':>4}: blocking {r['blocking_tok_s']:7.1f} "
            f"pipelined {r['pipelined_tok_s']:7.1f} tok/s, gain {r['gain']:.2f} ideal {r['ideal_gain']:.2f} "
            f"(F {r['F_ms']:.1f} S {r['S_ms']:.2f} B {r['B_ms']:.2f} ms; pipelined F {r['pipelined_F_ms']:.1f}), "
            f"idle {r['blocking_idle']:.0%} -> "
            f"{r['pipelined_idle']:.0%}",
            flush=True,
        )
    return rows


def grammar_section(per_subset: int, schemas: int) -> dict:
    """Ours vs raw llguidance (grammar_layer), and compile/mask vs xgrammar and outlines-core (grammar_peers)."""
    from foveal.grammars.conformance.feed import load_tokenizer

    tok = load_tokenizer()
    cases = grammar_layer.load_cases(tok, schemas)
    steps = grammar_layer.bench_steps(tok, cases)
    comp = grammar_layer.bench_compile(tok, cases)
    batch = grammar_layer.bench_batch(tok, cases)
    layer = {}
    for name, ours, raw, scale in (
        ("compile_ms", comp["ours"], comp["raw"], 1e3),
        ("commit_us", steps["commit_ours"], steps["commit_raw"], 1e6),
        ("mask_us", steps["mask_ours"], steps["mask_raw"], 1e6),
        ("fill_masks_64_us", batch["ours"], batch["raw"], 1e6),
    ):
        o, r = grammar_layer.pct(ours, 50) * scale, grammar_layer.pct(raw, 50) * scale
        layer[name] = {"ours_p50": o, "raw_p50": r, "ratio": o / r}
    report = grammar_peers.run(grammar_peers.schema_files(per_subset))
    grammar_peers.print_table(report)
    return {"layer_vs_llguidance": layer, "schemas": len(cases), "peers": report}


def image_section(folder: Path, device: str, quick: bool) -> dict:
    import foveal

    rows = {}
    with foveal.load(folder, device=device, max_batch_size=8) as model:
        for name, data in image_reuse.inputs(quick).items():
            rows[name] = image_reuse.measure(model, data, 2 if quick else 4, 1 if quick else 3)
            r = rows[name]
            print(
                f"  {name:<22} per call: raw {r['raw_per_call_ms']:.1f} ms, encode_image once "
                f"{r['encoded_per_call_ms']:.1f} ms (decode {r['decode_ms']:.1f}, vision {r['vision_ms']:.1f})",
                flush=True,
            )
    return rows


# ---- the run -------------------------------------------------------------------------------------------------


def run(quick: bool, device: str) -> dict:
    streams = [1, 8] if quick else [1, 8, 32]
    top = max(streams)
    tokens, repeat = (8, 1) if quick else (32, 3)
    report: dict[str, Any] = {"quick": quick, "machine": machine(device), "sections": {}}
    sections = report["sections"]
    with tempfile.TemporaryDirectory() as tmp:
        folder, label = embedded_folder(tmp)
        section = start("1. pipelining, embedded model: " + label)
        loaded = families.load(folder, device=device)
        rows = pipelining(loaded, label, streams, tokens, repeat)
        del loaded
        sections["pipelining_embedded"] = finish(section, rows=rows)

        section = start("5. image reuse (embedded model)")
        sections["image_reuse"] = finish(section, rows=image_section(folder, device, quick))

        source = peers.tiny_llama_folder(Path(tmp) / "tiny") if quick else smollm2_folder()
        name = "tiny random Llama (quick)" if quick else "SmolLM2-135M-Instruct"
        loaded = families.load(source, device=device)
        section = start(f"1-2. pipelining and the cost of structure, {name}")
        rows = pipelining(loaded, name, streams, tokens, repeat)
        automaton = grammars.compile(ENDLESS_BOXES, loaded.tokenizer, vocab_size=loaded.runner.vocab_size)
        constrained = pipelining(loaded, name, [top], tokens, repeat, automaton)
        del loaded
        sections["pipelining_llm"] = finish(section, rows=rows, constrained=constrained)

        section = start(f"3. peers, {name}")
        result = peers.run(source, 4 if quick else 32, warm=True, device=device)
        peers.print_table(result)
        sections["peers"] = finish(section, **result)

    section = start("6. less work per answer: prefix cache, jump-forward (benchmarks.less_work)")
    result = less_work.run(quick, device=device)
    less_work.print_table(result)
    sections["less_work"] = finish(section, **result)

    section = start("4. grammar layer")
    sections["grammar"] = finish(section, **grammar_section(2 if quick else 5, 5 if quick else 20))
    report["summary"] = summary(report)
    report["machine"]["load_average_end"] = os.getloadavg()
    return report


def start(title: str) -> dict:
    print(f"\n== {title}", flush=True)
    return {"title": title, "started": time.perf_counter(), "load_average_start": os.getloadavg()}


def finish(section: dict, **data: Any) -> dict:
    section["seconds"] = time.perf_counter() - section.pop("started")
    section["load_average_end"] = os.getloadavg()
    return section | data


# ---- the summary table ---------------------------------------------------------------------------------------


def summary(report: dict) -> list[dict]:
    """One row per headline figure: (area, measure, value, target or None)."""
    s = report["sections"]
    rows = []
    for key in ("pipelining_embedded", "pipelining_llm"):
        for r in s[key]["rows"]:
            rows.append(
                line(
                    "1 pipelining",
                    f"{short(r['model'])} x{r['streams']}: pipelined/blocking tok/s (ideal {r['ideal_gain']:.2f})",
                    r["gain"],
                )
            )
            rows.append(
                line(
                    "1 pipelining",
                    f"{short(r['model'])} x{r['streams']}: gain / ideal "
                    f"(idle {r['blocking_idle']:.0%} -> {r['pipelined_idle']:.0%})",
                    r["gain_over_ideal"],
                    TARGETS["pipelined gain / ideal"],
                )
            )
    llm = s["pipelining_llm"]
    c = llm["constrained"][0]
    free = next(r for r in llm["rows"] if r["streams"] == c["streams"])
    rows.append(
        line(
            "2 structure",
            f"{short(c['model'])} x{c['streams']}: constrained/unconstrained pipelined tok/s "
            f"({c['pipelined_tok_s']:.0f}/{free['pipelined_tok_s']:.0f})",
            c["pipelined_tok_s"] / free["pipelined_tok_s"],
            TARGETS["constrained / unconstrained tok/s at 32 streams"],
        )
    )
    peer_rows = {(r["workload"], r["contender"], r["constrained"]): r for r in s["peers"]["rows"]}
    for (workload, contender, constrained), r in peer_rows.items():
        if "error" in r:
            rows.append(line("3 peers", f"{workload}: {contender}: unavailable ({r['error'][:60]})", None))
            continue
        rows.append(
            line(
                "3 peers",
                f"{workload}: {contender}{'' if constrained else ', no grammar'}: "
                f"{r['tok_s']:.0f} tok/s, {r['valid_share']:.0%} valid; req/s",
                r["req_s"],
            )
        )
    for label, v in s["peers"]["ratios"].items():
        target = None
        if "outlines" in label:
            target = TARGETS["foveal / (generate + outlines), constrained"]
        elif "async" in label:
            target = TARGETS["foveal / generate_batch async, unconstrained"]
        if "unavailable" in v:
            rows.append(line("3 peers", f"foveal {label}: unavailable here", None, target))
        else:
            rows.append(
                line("3 peers", f"foveal {label}: req/s ratio (tok/s {v['tok_s']:.2f}x)", v["req_s"], target)
            )
    g = s["grammar"]
    for name, v in g["layer_vs_llguidance"].items():
        rows.append(
            line(
                "4 grammar",
                f"ours/raw llguidance p50 {name} ({v['ours_p50']:.2f} vs {v['raw_p50']:.2f})",
                v["ratio"],
            )
        )
    for engine, r in g["peers"]["results"].items():
        rows.append(
            line(
                "4 grammar",
                f"{engine}: compile ms p50 ({r['compiled']}/{r['schemas']} compiled, "
                f"mask p50 {r['mask_us'].get('p50', float('nan')):.1f} µs)",
                r["compile_ms"].get("p50"),
            )
        )
    for engine, message in g["peers"]["missing"].items():
        rows.append(line("4 grammar", f"{engine}: MISSING ({message[:60]})", None))
    for name, r in s["image_reuse"]["rows"].items():
        base = r.get("uncached_per_call_ms")  # image_reuse: the runner's image cache off
        if base is None:  # an image_reuse without the cache switch: the SDK-side reuse only
            base, label = r["raw_per_call_ms"], "raw bytes / encode_image once"
        else:
            label = "cache off / cache on + encode_image once"
            rows.append(
                line(
                    "5 image reuse",
                    f"{name}: ms per call, cache off / cache on ({base:.0f}/{r['raw_per_call_ms']:.0f})",
                    base / r["raw_per_call_ms"],
                )
            )
        rows.append(
            line(
                "5 image reuse",
                f"{name}: ms per call, {label} ({base:.0f}/{r['encoded_per_call_ms']:.0f})",
                base / r["encoded_per_call_ms"],
            )
        )
    for label, r in s.get("less_work", {}).get("ratios", {}).items():  # absent in runs saved before it
        rows.append(line("6 less work", f"foveal / {label}, requests/s", r["ratio"], r["target"]))
    return rows


def short(label: str) -> str:
    return label.split(",")[0].split(" (")[0]


def line(area: str, measure: str, value: float | None, target: float | None = None) -> dict:
    met = None if value is None or target is None else value >= target
    return {"area": area, "measure": measure, "value": value, "target": target, "met": met}


def print_summary(report: dict) -> None:
    m = report["machine"]
    print(
        f"\nfoveal benchmarks{' (--quick: smoke run, not a measurement)' if report['quick'] else ''}: "
        f"{m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, device {m['device']}, "
        f"load average {m['load_average'][0]:.2f} -> {m['load_average_end'][0]:.2f}"
    )
    print(", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    head = f"{'area':<14} {'measure':<92} {'value':>8} {'target':>7} {'met':>4}"
    print(head)
    print("-" * len(head))
    for r in report["summary"]:
        value = "-" if r["value"] is None else f"{r['value']:.2f}"
        target = "" if r["target"] is None else f">={r['target']:g}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['area']:<14} {r['measure']:<92} {value:>8} {target:>7} {met:>4}")


def markdown(report: dict) -> str:
    """The summary as a Markdown table (for README's Performance section)."""
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, device {m['device']}; "
        f"load average {m['load_average'][0]:.2f} at the start, {m['load_average_end'][0]:.2f} at the end; "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
        + f". Whole run: {report.get('seconds', 0) / 60:.0f} min.",
        "",
        "| area | measure | value | target | met |",
        "|---|---|---:|---:|:---:|",
    ]
    for r in report["summary"]:
        value = "-" if r["value"] is None else f"{r['value']:.2f}"
        target = "" if r["target"] is None else f"≥ {r['target']:g}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {r['area']} | {r['measure'].replace('|', '/')} | {value} | {target} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny models, few streams (smoke run of the harness)"
    )
    parser.add_argument("--json", default="out/benchmarks/run.json", help="where to write the report")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for every contender (default: 1 on CPU, see THREADS)",
    )
    parser.add_argument(
        "--markdown", metavar="RUN_JSON", help="print a saved run's summary as Markdown; no run"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        report = json.loads(Path(args.markdown).read_text())
        report["summary"] = summary(report)  # recomputed from the saved measurements
        print(markdown(report))
        return report
    threads = args.threads or (1 if args.device == "cpu" else 0)
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    report = run(args.quick, args.device)
    report["seconds"] = time.perf_counter() - started
    print_summary(report)
    out = write_json(args.json, report)
    print(f"\nwrote {out} ({report['seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
