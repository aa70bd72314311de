"""JSONSchemaBench subsets: compile coverage, false accepts / rejects on the labelled instances,
compile time and mask time per token, next to llguidance's own baseline verdicts on the same files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..compiler import compile
from ..errors import SchemaError
from .feed import CONFORMANCE, EOS, feed, percentile, serializations

SUBSETS = (
    "Github_trivial",
    "Github_easy",
    "Github_medium",
    "Glaiveai2K",
    "Snowplow",
    "Synthesized",
    "Handwritten",
)


def files(subset: str) -> list[Path]:
    return sorted((CONFORMANCE / "jsonschemabench" / subset).glob("*.json"))


def load_baseline() -> dict:
    path = CONFORMANCE / "grammars" / "llguidance" / "baselines" / "expected_maskbench.json"
    return json.loads(path.read_text())


def run_subset(subset: str, tok: Any, baseline: dict, limit: int | None = None) -> dict:
    stats: dict[str, Any] = {
        "files": 0,
        "compiled": 0,
        "refused": 0,
        "baseline_compiled": 0,
        "baseline_files": 0,
        "tests": 0,
        "pass": 0,
        "false_accept": 0,
        "false_reject": 0,
    }
    compile_ms: list[float] = []
    mask_us: list[float] = []
    false_accepts = []
    for path in files(subset)[:limit]:
        doc = json.loads(path.read_text())
        stats["files"] += 1
        base = baseline.get(f"{subset}---{path.name}")
        if base is not None:
            stats["baseline_files"] += 1
            stats["baseline_compiled"] += "json_error" not in base
        start = time.perf_counter()
        try:
            automaton = compile(doc["schema"], tok, eos_token_id=EOS)
        except SchemaError:
            stats["refused"] += 1
            continue
        compile_ms.append((time.perf_counter() - start) * 1e3)
        stats["compiled"] += 1
        for test in doc.get("tests", []):
            times: list[float] = []
            accepted = any(
                feed(automaton, tok.encode(text, add_special_tokens=False).ids, times)
                for text in serializations(test["data"], doc["schema"])
            )
            mask_us += [t * 1e6 for t in times]
            stats["tests"] += 1
            if accepted == test["valid"]:
                stats["pass"] += 1
            elif accepted:
                stats["false_accept"] += 1
                false_accepts.append({"file": path.name, "test": test.get("description")})
            else:
                stats["false_reject"] += 1
    stats.update(
        compile_ms_p50=percentile(compile_ms, 50),
        compile_ms_p99=percentile(compile_ms, 99),
        mask_us_p50=percentile(mask_us, 50),
        mask_us_p99=percentile(mask_us, 99),
        mask_samples=len(mask_us),
        false_accepts=false_accepts,
    )
    return stats


def run(tok: Any, subsets: tuple[str, ...] = SUBSETS, limit: int | None = None) -> dict:
    baseline = load_baseline()
    return {subset: run_subset(subset, tok, baseline, limit) for subset in subsets}


def table(result: dict) -> str:
    head = (
        f"{'subset':<16}{'files':>7}{'compiled':>9}{'llg base':>9}{'tests':>7}{'pass':>7}{'f.acc':>7}"
        f"{'f.rej':>7}{'cmp p50':>9}{'cmp p99':>9}{'mask p50':>10}{'mask p99':>10}"
    )
    lines = [
        "\nJSONSchemaBench (compile ms, mask µs per token; llg base = llguidance baseline compiled)",
        head,
    ]
    for subset, s in result.items():
        lines.append(
            f"{subset:<16}{s['files']:>7}{s['compiled']:>9}{s['baseline_compiled']:>9}{s['tests']:>7}"
            f"{s['pass']:>7}{s['false_accept']:>7}{s['false_reject']:>7}{s['compile_ms_p50']:>9.2f}"
            f"{s['compile_ms_p99']:>9.2f}{s['mask_us_p50']:>10.1f}{s['mask_us_p99']:>10.1f}"
        )
    return "\n".join(lines)
