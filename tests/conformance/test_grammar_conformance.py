"""The grammar layer against ../shared/conformance: a fast subset by default, full runs under
`-m conformance` (they take minutes). Zero false accepts everywhere; coverage at least llguidance's
baseline; zero invalid outputs from random walks.
"""

from __future__ import annotations

import pytest

from foveal.grammars.conformance import bench, cases, jsts, soundness
from foveal.grammars.conformance.feed import load_tokenizer

QUICK_KEYWORDS = ("properties", "required", "maximum", "enum", "items", "ref", "anyOf", "const", "pattern")


@pytest.fixture(scope="module")
def tok(shared_dir):
    return load_tokenizer()


def test_jsts_subset_has_no_false_accepts(tok):
    for draft in jsts.DRAFTS:
        verdicts = []
        for path in jsts.suite_files(draft):
            if jsts.keyword_of(path, draft) in QUICK_KEYWORDS:
                verdicts += [r["verdict"] for r in jsts.run_file(path, tok, draft)]
        assert len(verdicts) > 200
        assert "false_accept" not in verdicts
        assert verdicts.count("pass") > 0.8 * len(verdicts)


def test_jsonschemabench_subset_no_false_accepts_and_baseline_coverage(tok):
    baseline = bench.load_baseline()
    for subset in ("Github_easy", "Glaiveai2K"):
        stats = bench.run_subset(subset, tok, baseline, limit=15)
        assert stats["false_accept"] == 0, stats["false_accepts"]
        assert stats["compiled"] >= stats["baseline_compiled"] and stats["tests"] > 20


def test_engine_cases_have_no_false_accepts(tok):
    result = cases.run(tok)
    for name, r in result.items():
        assert r["counts"].get("false_accept", 0) == 0, (name, r["failures"][:3])
    assert result["llguidance_lark"]["counts"].get("compile_error_fail", 0) == 0
    assert result["outlines_lark"]["counts"] == {"pass": 5}


def test_random_walks_on_a_schema_sample_are_valid(tok):
    result = soundness.run(tok, n=25, max_tokens=600)
    assert result["compiled"] >= 15
    assert result["invalid"] == 0 and result["dead_ends"] == 0, result["invalid_outputs"][:3]
    assert result["valid"] >= 10


def test_soundness_validation_checks_formats():
    """A walk that breaks a `format` must count as invalid, in every draft the corpora use."""
    soundness.require_format_checkers()  # the dev extra's checker libraries are installed
    cases = {"date": '"2021-02-29"', "date-time": '"2021-01-01T24:00:00Z"', "time": '"12:00:00"'}
    cases |= {"hostname": '"-a-"', "email": '"no-at"', "ipv4": '"1.2.3.256"', "uri": '"no scheme"'}
    for draft in ("https://json-schema.org/draft/2020-12/schema", "http://json-schema.org/draft-07/schema#"):
        for fmt, text in cases.items():
            schema = {"$schema": draft, "type": "string", "format": fmt}
            assert soundness.validate(schema, text) is not None, (draft, fmt)
    assert soundness.validate({"format": "date"}, '"2024-02-29"') is None


def false_accepts(result: dict, optional: bool) -> list[dict]:
    return [
        f
        for r in result.values()
        for f in r["false_accepts"]
        if f["keyword"].startswith("optional/") == optional
    ]


@pytest.fixture(scope="module")
def full_jsts(tok):
    return jsts.run(tok)


@pytest.mark.conformance
def test_full_jsts_required(full_jsts):
    assert false_accepts(full_jsts, optional=False) == []


@pytest.mark.conformance
def test_full_jsts_optional(full_jsts):
    assert false_accepts(full_jsts, optional=True) == []


@pytest.mark.conformance
def test_full_jsonschemabench(tok):
    for subset, stats in bench.run(tok).items():
        assert stats["false_accept"] == 0, (subset, stats["false_accepts"][:5])
        assert stats["compiled"] >= stats["baseline_compiled"], subset


@pytest.mark.conformance
def test_full_soundness(tok):
    result = soundness.run(tok)
    assert result["compiled"] >= 1000
    assert result["invalid"] == 0 and result["dead_ends"] == 0, result["invalid_outputs"][:5]


def test_commit_only_and_mask_then_commit_agree_on_a_sample(tok):
    """Matcher invariant 5 on real schemas: feeding each labelled instance with and without mask
    fills, each on its own freshly compiled automaton, gives the same verdict."""
    import json

    from foveal.grammars.conformance.feed import feed, fresh_automaton, serializations
    from foveal.grammars.errors import SchemaError

    paths = soundness.sample_paths(40, seed=3)
    paths += [bench.files("Github_medium")[0].with_name(f"{n}.json") for n in ("o21115", "o21142")]
    compared = 0
    for path in paths:
        doc = json.loads(path.read_text())
        try:
            commit_only = fresh_automaton(doc["schema"], tok)
        except SchemaError:
            continue
        masked = fresh_automaton(doc["schema"], tok)
        for test in doc["tests"]:
            for text in serializations(test["data"], doc["schema"]):
                ids = tok.encode(text, add_special_tokens=False).ids
                assert feed(commit_only, ids) == feed(masked, ids, []), (path.name, text[:200])
                compared += 1
    assert compared > 100
