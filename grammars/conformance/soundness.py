"""Generation soundness: random walks under the mask over a sample of compiled JSONSchemaBench
schemas; every walk that ends must be JSON that validates against its schema (python-jsonschema,
with its format checker on: a walk that breaks a `format` is invalid). python-jsonschema silently
skips a format whose checker library is missing (`date-time`/`time`: rfc3339-validator,
`hostname`: fqdn, `uri`/`uri-reference`: rfc3986-validator, all in the dev extra), so `run`
refuses to start without them.
A walk that hits max_tokens is "unfinished" (the pull towards closing was not enough), not invalid;
one that llguidance stops on a resource limit mid-output (GrammarLimitError) is counted apart;
an empty mask before termination is a dead end and counts as a failure.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..compiler import compile
from ..errors import SchemaError
from ..walk import random_walk
from .bench import SUBSETS, files
from .feed import EOS


def sample_paths(n: int, seed: int = 0) -> list:
    paths = [p for subset in SUBSETS for p in files(subset)]
    rng = np.random.default_rng(seed)
    return [paths[i] for i in sorted(rng.choice(len(paths), size=min(n, len(paths)), replace=False))]


CHECKED_FORMATS = (
    "date",
    "date-time",
    "time",
    "hostname",
    "email",
    "ipv4",
    "ipv6",
    "uuid",
    "uri",
    "uri-reference",
)


def require_format_checkers() -> None:
    """Raise before any walk if python-jsonschema would skip one of CHECKED_FORMATS."""
    import jsonschema

    # the draft-2020-12 checker knows every format here; older drafts' checkers use the same libraries
    missing = [f for f in CHECKED_FORMATS if f not in jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers]
    if missing:
        raise RuntimeError(
            f"python-jsonschema cannot check format(s) {missing} here, so invalid walks would pass; "
            "install the dev extra: pip install -c constraints.txt -e '.[dev]'"
        )


def validate(schema: Any, text: str) -> str | None:
    """None if the text is JSON valid under the schema, else the reason."""
    import re

    import jsonschema
    import referencing.exceptions

    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not JSON: {err}"
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    except (
        jsonschema.exceptions.SchemaError,
        referencing.exceptions.Unresolvable,
        re.error,
        RecursionError,
    ) as err:
        return f"validator could not run: {type(err).__name__}"
    return None if error is None else error.message[:200]


def run(tok: Any, n: int = 1400, max_tokens: int = 1500, seed: int = 0) -> dict:
    require_format_checkers()
    rng = np.random.default_rng(seed)
    stats: dict[str, Any] = {
        "sampled": 0,
        "compiled": 0,
        "terminated": 0,
        "unfinished": 0,
        "dead_ends": 0,
        "resource_limits": 0,
        "valid": 0,
        "invalid": 0,
        "validator_errors": 0,
    }
    invalid = []
    limits = []
    for path in sample_paths(n, seed):
        schema = json.loads(path.read_text())["schema"]
        stats["sampled"] += 1
        try:
            automaton = compile(schema, tok, eos_token_id=EOS)
        except SchemaError:
            continue
        stats["compiled"] += 1
        walk = random_walk(automaton, rng, max_tokens=max_tokens, pull=0.01)
        if walk.empty_mask:
            stats["dead_ends"] += 1
            invalid.append({"file": path.name, "reason": "empty mask before termination"})
            continue
        if walk.limit:
            stats["resource_limits"] += 1
            limits.append({"file": f"{path.parent.name}/{path.name}", "reason": walk.limit[:200]})
            continue
        if not walk.terminated:
            stats["unfinished"] += 1
            continue
        stats["terminated"] += 1
        text = automaton.tokenizer.ll.decode_bytes(walk.tokens).decode("utf-8", errors="replace")
        reason = validate(schema, text)
        if reason is None:
            stats["valid"] += 1
        elif reason.startswith("validator could not run"):
            stats["validator_errors"] += 1
        else:
            stats["invalid"] += 1
            invalid.append({"file": f"{path.parent.name}/{path.name}", "reason": reason, "text": text[:300]})
    stats["invalid_outputs"] = invalid
    stats["resource_limit_files"] = limits
    return stats


def table(result: dict) -> str:
    keys = (
        "sampled",
        "compiled",
        "terminated",
        "unfinished",
        "dead_ends",
        "resource_limits",
        "valid",
        "invalid",
        "validator_errors",
    )
    return "\nGeneration soundness (random walks)\n" + "  ".join(f"{k}={result[k]}" for k in keys)
