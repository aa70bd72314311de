"""Smoke runs of the benchmark harness (benchmarks/run.py and its pieces) on tiny models, so it cannot rot.

These check that every piece runs and reports what it claims, not how fast anything is: speed
figures come from `python -m benchmarks.run` (see README, Performance).
"""

from __future__ import annotations

import json

import pytest

from benchmarks import grammar_peers, peers, pipeline, run
from foveal import grammars


def test_validity_checkers_accept_answers_and_refuse_the_rest():
    assert peers.valid_json('{"name": "Ada", "age": 36, "colors": ["red"]}')
    assert not peers.valid_json('{"name": "Ada", "age": 360, "colors": []}')  # maximum 120
    assert not peers.valid_json('{"name": "Ada", "age": 36')  # cut short
    assert not peers.valid_json(RuntimeError("cut"))  # a call that raised
    box = {"x_min": 0.1, "y_min": 0.2, "x_max": 0.5, "y_max": 0.6}
    assert peers.valid_detect({"objects": [box]})
    assert peers.valid_detect(json.dumps({"objects": []}))
    assert not peers.valid_detect({"objects": [box | {"x_min": 0.7}]})  # x_min > x_max: not a box
    assert not peers.valid_detect({"objects": [box | {"y_max": 1.5}]})  # outside [0, 1]
    assert not peers.valid_detect({"objects": [box] * (peers.MAX_OBJECTS + 1)})
    assert not peers.valid_detect("Sure! Here are the boxes")


def test_peers_run_every_contender_on_both_workloads(tiny_folder, monkeypatch):
    import torch

    # outlines-core's mask kernel is torch.compile'd: ~13 s on first use here; eager is enough for a smoke run
    # (the benchmark itself runs each contender once untimed first, so that compile is never timed).
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    report = peers.run(tiny_folder, requests=2, warm=False, max_tokens=96)  # one detect item fits, however spelled
    rows = {(r["workload"], r["contender"], r["constrained"]): r for r in report["rows"]}
    assert len(rows) == 12  # 2 workloads x 6 contenders
    for workload in ("json", "detect"):
        ours = rows[(workload, "foveal pipelined", True)]
        assert ours["requests"] == 2 and ours["tokens"] > 0 and ours["tok_s"] > 0
        cb_async = rows[(workload, "transformers generate_batch (async)", False)]
        assert "requires a device type" in cb_async["error"]  # transformers refuses async batching on CPU
        # A constrained answer is valid, or raised IncompleteOutputError when max_tokens cut it: never wrong.
        assert ours["valid_share"] * ours["requests"] + ours["raised"] == ours["requests"]
    assert set(report["ratios"]) >= {
        "json vs generate+outlines (constrained)",
        "detect vs generate (unconstrained)",
    }


def test_pipelined_and_blocking_runs_decode_the_same_tokens(tiny_loaded):
    automaton = grammars.compile(
        run.ENDLESS_BOXES, tiny_loaded.tokenizer, vocab_size=tiny_loaded.runner.vocab_size
    )
    for grammar in (None, automaton):
        _, blocking = pipeline.run_real(tiny_loaded, grammar, 3, pipelined=False, tokens=6)
        _, pipelined = pipeline.run_real(tiny_loaded, grammar, 3, pipelined=True, tokens=6)
        assert [len(ids) for ids in blocking] == [6, 6, 6]
        assert pipelined == blocking


def test_a_run_that_decodes_other_tokens_is_refused_not_measured(tiny_loaded, monkeypatch):
    real_run = pipeline.run_real

    def pipelined_differs(loaded, automaton, streams, pipelined, tokens):
        stats, token_ids = real_run(loaded, automaton, streams, pipelined, tokens)
        return stats, [[(t + 1) % 7 for t in ids] for ids in token_ids] if pipelined else token_ids

    monkeypatch.setattr(pipeline, "run_real", pipelined_differs)
    with pytest.raises(RuntimeError, match="token-identical"):
        run.pipelining(tiny_loaded, "tiny", [2], tokens=4, repeat=1)


def test_pipelining_rows_report_both_modes_and_the_grammar(tiny_loaded):
    free = run.pipelining(tiny_loaded, "tiny", [2], tokens=6, repeat=1)
    automaton = grammars.compile(
        run.ENDLESS_BOXES, tiny_loaded.tokenizer, vocab_size=tiny_loaded.runner.vocab_size
    )
    constrained = run.pipelining(tiny_loaded, "tiny", [2], tokens=6, repeat=1, automaton=automaton)
    for r in free + constrained:
        assert r["streams"] == 2 and r["ideal_gain"] >= 1.0
        assert r["blocking_tok_s"] > 0 and r["pipelined_tok_s"] > 0
        assert 0 <= r["pipelined_idle"] <= 1 and 0 <= r["blocking_idle"] <= 1
    assert constrained[0]["constrained"] and not free[0]["constrained"]


def test_grammar_peers_compile_and_walk_or_say_what_is_missing(data_dir):
    report = grammar_peers.run([data_dir / "conformance/jsonschemabench/Github_trivial/o19978.json"])
    assert report["files"] == ["Github_trivial/o19978.json"]
    ours = report["results"]["foveal (llguidance)"]
    assert ours["schemas"] == 1 and ours["compiled"] == 1 and ours["walked"] == 1
    for name in ("xgrammar", "outlines-core"):
        assert (name in report["results"]) != (name in report["missing"])
    for message in report["missing"].values():
        assert "pip install" in message


def test_machine_description_names_cpu_versions_and_load():
    m = run.machine("cpu")
    assert m["cores"] >= 1 and len(m["load_average"]) == 3
    assert m["versions"]["torch"] != "not installed" and m["versions"]["llguidance"] != "not installed"


@pytest.mark.slow
def test_run_quick_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "run.json"
    report = run.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(report["summary"], default=str))
    areas = {r["area"] for r in report["summary"]}
    assert areas == {"1 pipelining", "2 structure", "3 peers", "4 grammar", "5 image reuse", "6 less work"}
    assert "target" in capsys.readouterr().out


@pytest.mark.slow
def test_device_check_cpu_smoke(tmp_path):
    from benchmarks import device_check

    assert device_check.main(["--cpu", "--quick", "--json", str(tmp_path / "device.json")]) == 0


@pytest.mark.slow
def test_less_work_quick_measures_every_workload_and_names_each_target(tmp_path, capsys):
    from benchmarks import less_work

    less_work.main(["--quick", "--calls", "1", "--out", str(tmp_path / "less_work.json")])
    report = json.loads((tmp_path / "less_work.json").read_text())
    assert {r["workload"] for r in report["rows"]} == {"shared prefix", "image objects", "json latency", "json", "detect"}
    assert all(r["n"] > 0 and 0 <= r["valid"] <= r["n"] for r in report["rows"])
    assert all(r["valid"] == r["n"] for r in report["rows"] if r["contender"].startswith("foveal"))
    assert "target >= 3.0x" in capsys.readouterr().out


@pytest.mark.slow
def test_jump_forward_quick_compares_the_answers_of_both_modes(tmp_path):
    from benchmarks import jump_forward

    jump_forward.main(["--quick", "--calls", "2", "--requests", "4", "--out", str(tmp_path / "jf.json")])
    report = json.loads((tmp_path / "jf.json").read_text())
    for workload in report["workloads"].values():
        answers = workload["batch_answers"]
        assert answers["valid_on"] == answers["valid_off"] == answers["answers"] == 4
        assert workload["batch"]["off"]["forced_tokens"] == 0
