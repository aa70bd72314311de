"""Smoke test of benchmarks/cold_start.py (fresh processes: load and first calls, foveal vs llama.cpp).

A real run needs the SmolLM2 GGUF in foveal's cache (and llama-cpp-python for its contender), so it
is `slow` and skips, saying which, when they are missing. The rows' arithmetic and the import list
are checked by default, on made-up process reports.
"""

import pytest

from benchmarks import cold_start
from foveal.engine.models import ModelLoadError
from foveal.testing.smollm2 import smollm2_gguf


def _process(cold: float, first: float, steady: float, load: float = 1.0) -> dict:
    return {
        "import_s": 0.5,
        "load_s": load,
        "json_s": 1.0,
        "first_free_s": cold - load - 1.0,
        "cold_s": cold,
        "first_tokens_per_s": first,
        "steady_tokens_per_s": steady,
        "load_average": (0.5, 0.5, 0.5),
    }


def test_rows_are_medians_and_ratios_compare_cold_time_and_first_calls(capsys):
    foveal = cold_start.row("foveal", [_process(4.0, 40.0, 50.0, 2.0), _process(6.0, 30.0, 50.0, 3.0)])
    llama = cold_start.row("llama.cpp", [_process(2.0, 70.0, 70.0, 0.2), _process(3.0, 70.0, 70.0, 0.3)])
    assert foveal["cold_s"] == 4.0 and foveal["first_tokens_per_s"] == 30.0  # the lower middle of two
    assert foveal["first_vs_steady"] == pytest.approx(0.6)
    ratios = cold_start.ratios([foveal, llama])
    assert ratios["cold_s_vs_llamacpp"] == pytest.approx(2.0)
    assert ratios["load_s_vs_llamacpp"] == pytest.approx(10.0)
    assert ratios["llama.cpp_first_three_vs_steady"] == pytest.approx(1.0)
    report = {"model": "/x/m.gguf", "threads": 2, "free_tokens": 8, "rows": [foveal, llama], "ratios": ratios}
    cold_start.print_table(report)
    assert "cold_s_vs_llamacpp 2.00" in capsys.readouterr().out


def test_top_imports_keeps_top_level_modules_by_cumulative_time():
    stderr = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:       100 |     900000 |   torch._C",
            "import time:      2000 |    1500000 | torch",
            "import time:        50 |     300000 | transformers",
            "some other line",
        ]
    )
    rows = cold_start.top_imports(stderr)
    assert [r["module"] for r in rows] == ["torch", "transformers"]
    assert rows[0]["cumulative_s"] == pytest.approx(1.5)


@pytest.mark.slow  # fresh processes loading a 93 MB GGUF: tens of seconds
def test_a_short_run_of_fresh_foveal_processes_reports_every_row():
    try:
        path = smollm2_gguf(download=False)
    except ModelLoadError as error:
        pytest.skip(f"the SmolLM2 GGUF is not cached: {error}")
    report = cold_start.run(threads=1, rounds=1, free_tokens=8, steady=1, gguf=str(path), contenders=("foveal",))
    (row,) = report["rows"]
    assert row["cold_s"] > row["load_s"] > row["import_s"] > 0
    assert row["first_tokens_per_s"] > 0 and row["steady_tokens_per_s"] > 0
    assert '"name"' in report["runs"]["foveal"][0]["json_text"]
