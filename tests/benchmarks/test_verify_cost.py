"""Smoke test of `python -m benchmarks.speculative --verify-cost`: the ggml runner's verify rows timed.

Needs llama-cpp-python (the `gguf` extra) and the SmolLM2 GGUF in foveal's cache; skips, saying
which, when either is missing. It checks what the table reports, not how fast anything is.
"""

import pytest

from benchmarks import speculative
from foveal.engine.models import ModelLoadError
from foveal.testing.smollm2 import smollm2_gguf


def test_every_context_and_width_is_timed_against_one_position(capsys):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[gguf]')")
    try:
        smollm2_gguf(download=False)
    except ModelLoadError as error:
        pytest.skip(f"the SmolLM2 GGUF is not cached: {error}")
    report = speculative.verify_cost(rounds=1, threads=1)
    rows = {(r["context"], r["positions"]): r for r in report["rows"]}
    assert set(rows) == {(c, n) for c in speculative.VERIFY_CONTEXTS for n in speculative.VERIFY_WIDTHS}
    for (_, n), row in rows.items():
        assert row["ms"] > 0
        assert row["best_speedup"] == pytest.approx(n / row["cost_vs_one"])
        if n == 1:
            assert row["cost_vs_one"] == 1.0
    speculative.print_verify_cost(report)
    assert "best speedup" in capsys.readouterr().out
