"""Smoke run of benchmarks/pixel_budget.py's measured step, in process and small, so that it cannot rot.

It checks what the benchmark reports, not memory figures (those come from running it).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is not part of the package
    sys.path.insert(0, str(ROOT))

from benchmarks import pixel_budget  # noqa: E402


def test_reduced_and_full_steps_report_their_decodes(tmp_path):
    target, _ = pixel_budget.embedded_target()
    assert target == (64, 64)  # sdk/embedded/preprocessor_config.json
    data = tmp_path / "image.jpg"
    data.write_bytes(pixel_budget.near_uniform_jpeg(1600, progressive=False))
    reduced = pixel_budget.child(str(data), 4, reduced=True, bounded=True, budget_pixels=10**8, timeout_s=30)
    full = pixel_budget.child(
        str(data), 4, reduced=False, bounded=True, budget_pixels=1600 * 1600, timeout_s=30
    )
    assert reduced["served"] == full["served"] == 4 and reduced["distinct_keys"] == 1
    assert reduced["decoded"] == ["200x200:(64, 64, 3)"]  # 1/8 by DCT scaling: 3x the target still fits
    assert full["decoded"] == ["1600x1600:(64, 64, 3)"]
    assert full["budget_peak_pixels"] == 1600 * 1600, "one full decode at a time under that budget"
    assert reduced["budget_peak_pixels"] <= 4 * 200 * 200
    assert reduced["peak_rss_mb"] >= reduced["rss_before_mb"] > 0
    assert "reduced" in pixel_budget.table({"reduced": reduced, "full": full})
