"""foveal's benchmarks (not part of the package): `python -m benchmarks.<name>`; each prints a table and writes JSON."""

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, report: Any) -> Path:
    """Write a benchmark's report (its folder created if needed); returns the path written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    return out
