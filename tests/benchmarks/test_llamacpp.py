"""Smoke test of benchmarks/llamacpp.py (foveal vs llama.cpp on the same GGUF).

The run itself needs llama-cpp-python (the `bench` extra, built from source) and the SmolLM2 GGUF
already in foveal's cache, so it is `slow` (opt-in) and skips, saying which, when either is
missing (nothing is downloaded). The report's arithmetic is checked without them, by default.
"""

import pytest

from benchmarks import llamacpp
from foveal.engine.models import ModelLoadError
from foveal.testing.smollm2 import smollm2_gguf


def test_ratios_compare_each_row_in_its_own_direction(capsys):
    report = {
        "threads": 2,
        "machine": {"load_average": (1.0, 1.0, 1.0)},
        "load": [{"contender": "foveal", "seconds": 2.0}, {"contender": "llama.cpp", "seconds": 0.5}],
        "free_text": [
            {"contender": "foveal", "tokens": 100, "seconds": 1.0, "tokens_per_s": 100.0},
            {"contender": "llama.cpp", "tokens": 100, "seconds": 0.8, "tokens_per_s": 125.0},
        ],
        "json_call": [
            {"contender": "foveal", "calls": 1, "median_ms": 300.0, "tokens_per_call": 25, "valid": 1.0},
            {"contender": "llama.cpp", "calls": 1, "median_ms": 400.0, "tokens_per_call": 25, "valid": 1.0},
        ],
        "concurrent_json": [
            {
                "contender": "foveal (all at once)",
                "requests": 32,
                "requests_per_s": 8.0,
                "tokens_per_s": 1,
                "valid": 1.0,
            },
            {
                "contender": "llama.cpp (one by one)",
                "requests": 32,
                "requests_per_s": 2.0,
                "tokens_per_s": 1,
                "valid": 1.0,
            },
            {"contender": "transformers + outlines (batch)", "unavailable": "ImportError: no outlines"},
        ],
    }
    report["ratios"] = ratios = llamacpp.ratios(report)
    assert ratios["free_text_tokens_per_s_vs_llamacpp"] == pytest.approx(0.8)
    assert ratios["json_call_latency_vs_llamacpp"] == pytest.approx(0.75)
    assert ratios["concurrent_requests_per_s_vs_llamacpp"] == pytest.approx(4.0)
    assert "concurrent_requests_per_s_vs_outlines" not in ratios  # unavailable rows are not compared
    assert ratios["load_seconds_vs_llamacpp"] == pytest.approx(4.0)
    llamacpp.print_table(report)
    assert "unavailable: ImportError" in capsys.readouterr().out


def test_rounds_give_the_median_round_and_the_median_of_paired_ratios():
    rounds = [{"contender": "x", "requests_per_s": v} for v in (3.0, 1.0, 2.0, 4.0)]
    row = llamacpp.median_round(rounds)
    assert row["requests_per_s"] == 2.0 and row["rounds_requests_per_s"] == [3.0, 1.0, 2.0, 4.0]
    report = {
        "load": [{"contender": "foveal", "seconds": 1.0}, {"contender": "llama.cpp", "seconds": 1.0}],
        "free_text": [{"contender": c, "tokens_per_s": 1.0} for c in ("foveal", "llama.cpp")],
        "json_call": [{"contender": c, "median_ms": 1.0} for c in ("foveal", "llama.cpp")],
        "concurrent_json": [
            {"contender": "foveal (all at once)", "requests_per_s": 4.0, "rounds_vs_outlines": [1.5, 2.5, 2.1]},
            {"contender": "transformers + outlines (batch)", "requests_per_s": 1.0},
        ],
    }
    # each round's pair ran back to back: their ratios' median, not the ratio of the two medians (4.0)
    assert llamacpp.ratios(report)["concurrent_requests_per_s_vs_outlines"] == pytest.approx(2.1)


@pytest.mark.slow  # needs the bench extra (llama-cpp-python, built from source) and the cached GGUF
def test_a_tiny_run_measures_both_and_checks_every_output():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[bench]' in foveal's clone)")
    try:
        path = smollm2_gguf(download=False)
    except ModelLoadError as error:
        pytest.skip(f"the SmolLM2 GGUF is not cached: {error}")
    report = llamacpp.run(threads=1, requests=2, calls=1, free_tokens=8, outlines=False, gguf=path)
    assert {r["contender"] for r in report["load"]} == {"foveal", "llama.cpp"}
    assert all(r["tokens"] > 0 for r in report["free_text"])
    assert all(r["valid"] == 1.0 for r in report["json_call"] + report["concurrent_json"])  # both constrain
    assert set(report["ratios"]) >= {"free_text_tokens_per_s_vs_llamacpp", "json_call_latency_vs_llamacpp"}


def test_the_kernel_table_times_every_kernel_for_every_launch_size(capsys):
    from foveal.engine.models.quant import fp16_kernel_available

    if not fp16_kernel_available():
        pytest.skip("the fp16 and split kernels need torch's fbgemm (x86)")
    report = llamacpp.kernels([1, 6], repeats=1, layers=1)
    assert set(report["ms"]) == set(llamacpp.KERNELS)
    assert all(set(by_rows) == {1, 6} and min(by_rows.values()) > 0 for by_rows in report["ms"].values())
    llamacpp.print_kernels(report)
    assert "split" in capsys.readouterr().out


@pytest.mark.slow  # loads the cached SmolLM2 GGUF and traces its decode step four times
def test_the_step_anatomy_times_every_part_on_each_thread_count():
    try:
        smollm2_gguf(download=False)
    except ModelLoadError as error:
        pytest.skip(f"the SmolLM2 GGUF is not cached: {error}")
    report = llamacpp.step_anatomy(rounds=1, threads=(1, 2), repeats=1)
    assert report["fused_logits_equal"]  # fused projections give the separate ones' logits exactly
    parts = {(row["part"], row["threads"]) for row in report["rows"]}
    assert len(parts) == 4 * 2 and all(row["ms"] > 0 for row in report["rows"])
    bytes_read = report["bytes_per_token"]
    assert bytes_read["foveal_layers_mb"] == pytest.approx(bytes_read["llamacpp_layers_mb"])  # the same Q4_1 codes


def test_decode_thread_rows_get_ratios_of_their_own_and_the_engines_row_stays_the_headline():
    free = [
        {"contender": "foveal", "tokens_per_s": 30.0},
        {"contender": "foveal, decode on 2 thread(s)", "tokens_per_s": 45.0},
        {"contender": "llama.cpp", "tokens_per_s": 50.0},
    ]
    calls = [
        {"contender": "foveal", "median_ms": 400.0},
        {"contender": "foveal, decode on 2 thread(s)", "median_ms": 300.0},
        {"contender": "llama.cpp", "median_ms": 1000.0},
    ]
    report = {
        "load": [{"contender": "foveal", "seconds": 1.0}, {"contender": "llama.cpp", "seconds": 1.0}],
        "free_text": free,
        "json_call": calls,
        "concurrent_json": [{"contender": "foveal (all at once)", "requests_per_s": 1.0}],
    }
    ratios = llamacpp.ratios(report)
    assert ratios["free_text_tokens_per_s_vs_llamacpp"] == pytest.approx(0.6)
    assert ratios["free_text_tokens_per_s_vs_llamacpp (decode on 2 thread(s))"] == pytest.approx(0.9)
    assert ratios["json_call_latency_vs_llamacpp (decode on 2 thread(s))"] == pytest.approx(0.3)
