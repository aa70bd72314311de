"""Grammar cases from other engines' test suites (../shared/conformance/grammars):
- llguidance `test_lark.rs` cases: accept / reject strings per Lark grammar, grammars that must fail
  to compile (`compile_error`) or must compile (`compile_ok`);
- outlines-core `json_schema_mod.rs` cases: strings per schema; the truth is python-jsonschema's
  verdict (`reference_jsonschema`), not outlines' whitespace-specific labels. Texts valid as written
  but in another whitespace style are also checked re-serialized in our canonical style;
- outlines' Lark grammars (json, arithmetic) with the sample texts they must accept.
A false accept is an accepted string that must be rejected: a soundness bug.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from ..compiler import compile
from ..errors import SchemaError
from ..specs import CFG
from .feed import CONFORMANCE, EOS, feed, serializations

GRAMMARS = CONFORMANCE / "grammars"


def accepts(automaton: Any, text: str, tok: Any) -> bool:
    return feed(automaton, tok.encode(text, add_special_tokens=False).ids)


def lark_cases(tok: Any) -> dict:
    doc = json.loads((GRAMMARS / "llguidance" / "cases" / "test_lark.rs.cases.json").read_text())
    stats: Counter = Counter()
    failures = []
    for case in doc["cases"]:
        try:
            automaton = compile(CFG(case["grammar"]), tok, eos_token_id=EOS)
            error = None
        except SchemaError as err:
            automaton, error = None, str(err)
        kind = case["kind"]
        if kind == "compile_error":
            ok = automaton is None and case.get("error_contains", "") in (error or "")
            stats["compile_error_pass" if ok else "compile_error_fail"] += 1
            if automaton is not None:
                failures.append({"grammar": case["grammar"][:200], "why": "compiled but must fail"})
            continue
        if automaton is None:
            stats["refused"] += 1
            assert error is not None  # the compile raised
            failures.append({"grammar": case["grammar"][:200], "why": f"refused: {error[:200]}"})
            continue
        if kind == "compile_ok":
            stats["compile_ok_pass"] += 1
            continue
        for text in case.get("accept", []):
            ok = accepts(automaton, text, tok)
            stats["pass" if ok else "false_reject"] += 1
        for text in case.get("reject", []):
            text = text.removeprefix("FINAL_REJECT:")
            if accepts(automaton, text, tok):
                stats["false_accept"] += 1
                failures.append({"grammar": case["grammar"][:200], "text": text, "why": "false accept"})
            else:
                stats["pass"] += 1
    return {"counts": dict(stats), "failures": failures}


def outlines_core_cases(tok: Any) -> dict:
    doc = json.loads((GRAMMARS / "outlines-core" / "cases" / "json_schema_mod.rs.cases.json").read_text())
    stats: Counter = Counter()
    failures = []
    for case in doc["cases"]:
        try:
            automaton = compile(case["schema"], tok, eos_token_id=EOS)
        except SchemaError:
            stats["refused"] += 1
            continue
        for text, truth in (case.get("reference_jsonschema") or {}).items():
            accepted = accepts(automaton, text, tok)
            if truth is True:
                canonical = accepted or any(
                    accepts(automaton, t, tok) for t in serializations(json.loads(text), case["schema"])
                )
                stats["pass" if canonical else "false_reject"] += 1
                stats["valid_other_whitespace_rejected"] += not accepted
            elif accepted:
                stats["false_accept"] += 1
                failures.append({"schema": case["schema"], "text": text, "truth": truth})
            else:
                stats["pass"] += 1
    return {"counts": dict(stats), "failures": failures}


def outlines_lark_samples(tok: Any) -> dict:
    stats: Counter = Counter()
    failures = []
    grammar_dir = GRAMMARS / "outlines" / "src" / "outlines" / "grammars"
    for name in ("json", "arithmetic"):
        try:
            automaton = compile(CFG((grammar_dir / f"{name}.lark").read_text()), tok, eos_token_id=EOS)
        except SchemaError as err:
            stats["refused_grammars"] += 1
            failures.append({"grammar": name, "why": str(err)[:300]})
            continue
        for sample in sorted((GRAMMARS / "outlines" / "tests" / "cfg_samples" / name).glob("*.test")):
            ok = accepts(automaton, sample.read_text().rstrip("\n"), tok)  # files end with a newline
            stats["pass" if ok else "false_reject"] += 1
            if not ok:
                failures.append({"grammar": name, "sample": sample.name})
    return {"counts": dict(stats), "failures": failures}


def run(tok: Any) -> dict:
    return {
        "llguidance_lark": lark_cases(tok),
        "outlines_core_json": outlines_core_cases(tok),
        "outlines_lark": outlines_lark_samples(tok),
    }


def table(result: dict) -> str:
    lines = ["\nGrammar cases from other engines"]
    for name, r in result.items():
        lines.append(f"{name:<22}{r['counts']}")
    return "\n".join(lines)
