"""JSON-Schema-Test-Suite (draft2020-12, draft7): every schema compiles or is refused with SchemaError;
every instance, serialized in the grammar's style, must be accepted when valid and rejected when not.
Verdicts per test: pass, false_accept (an invalid instance the automaton accepts: a soundness bug),
false_reject (a valid instance it cannot emit), refused (the schema was refused at compile time).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from ..compiler import compile
from ..errors import SchemaError
from .feed import CONFORMANCE, EOS, feed, serializations

DRAFTS = ("draft2020-12", "draft7")
VERDICTS = ("pass", "false_accept", "false_reject", "refused")


def suite_files(draft: str) -> list[Path]:
    return sorted((CONFORMANCE / "jsts" / "tests" / draft).rglob("*.json"))


def keyword_of(path: Path, draft: str) -> str:
    return str(path.relative_to(CONFORMANCE / "jsts" / "tests" / draft).with_suffix(""))


DIALECTS = {
    "draft2020-12": "https://json-schema.org/draft/2020-12/schema",
    "draft7": "http://json-schema.org/draft-07/schema#",
}


def with_dialect(schema: Any, draft: str) -> Any:
    """The suite's schemas are written for its draft but rarely say so; say it, as a user's schema would."""
    if isinstance(schema, dict) and "$schema" not in schema:
        return {"$schema": DIALECTS[draft], **schema}
    return schema


def run_file(path: Path, tok: Any, draft: str) -> list[dict]:
    """Verdicts of every test of one suite file."""
    results = []
    for group in json.loads(path.read_text()):
        try:
            automaton = compile(with_dialect(group["schema"], draft), tok, eos_token_id=EOS)
            error = None
        except SchemaError as err:
            automaton, error = None, str(err).splitlines()[0]
        for test in group["tests"]:
            verdict = "refused"
            if automaton is not None:
                accepted = any(
                    feed(automaton, tok.encode(text, add_special_tokens=False).ids)
                    for text in serializations(test["data"], group["schema"])
                )
                if test["valid"]:
                    verdict = "pass" if accepted else "false_reject"
                else:
                    verdict = "false_accept" if accepted else "pass"
            results.append(
                {
                    "group": group["description"],
                    "test": test["description"],
                    "valid": test["valid"],
                    "verdict": verdict,
                    "error": error,
                }
            )
    return results


def run(tok: Any, drafts: tuple[str, ...] = DRAFTS, limit_files: int | None = None) -> dict:
    out: dict[str, Any] = {}
    for draft in drafts:
        per_keyword: dict[str, Counter] = defaultdict(Counter)
        details: dict[str, list[dict]] = {}
        for path in suite_files(draft)[:limit_files]:
            keyword = keyword_of(path, draft)
            results = run_file(path, tok, draft)
            details[keyword] = results
            per_keyword[keyword].update(r["verdict"] for r in results)
        total = sum(per_keyword.values(), Counter())
        out[draft] = {
            "total": dict(total),
            "per_keyword": {k: dict(v) for k, v in per_keyword.items()},
            "false_accepts": [
                dict(keyword=k, **r)
                for k, rs in details.items()
                for r in rs
                if r["verdict"] == "false_accept"
            ],
            "baseline": baseline(draft),
        }
    return out


def baseline(draft: str) -> dict | None:
    """llguidance's own verdict counts on this draft (its baselines file), for side-by-side reading."""
    path = CONFORMANCE / "grammars" / "llguidance" / "baselines" / "expected_json_schema_test_suite.json"
    data = json.loads(path.read_text()).get(draft)
    if data is None:
        return None
    counts: Counter = Counter()
    for groups in data.values():
        for tests in groups.values():
            counts.update(tests.values())
    return dict(counts)


def table(result: dict) -> str:
    lines = []
    for draft, r in result.items():
        lines.append(f"\nJSON-Schema-Test-Suite {draft}")
        lines.append(f"{'keyword':<42}" + "".join(f"{v:>14}" for v in VERDICTS))
        for keyword, counts in sorted(r["per_keyword"].items()):
            lines.append(f"{keyword:<42}" + "".join(f"{counts.get(v, 0):>14}" for v in VERDICTS))
        lines.append(f"{'TOTAL':<42}" + "".join(f"{r['total'].get(v, 0):>14}" for v in VERDICTS))
        if r["baseline"]:
            lines.append(f"llguidance baseline verdicts ({draft}): {r['baseline']}")
    return "\n".join(lines)
