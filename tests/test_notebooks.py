"""The notebooks in notebooks/ run top to bottom (nbclient) and are stored without outputs.

They run on the embedded model, as a reader's `foveal.load()` does (FOVEAL_MODEL unset).
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["01_quickstart", "02_structured_output", "03_engine"]
# A notebook takes 10-15 s here (a kernel importing torch and transformers); all three run by default,
# so that CI executes every notebook the README links to.
RUNS = NAMES


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_without_outputs(name):
    notebook = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, (
                f"{name}: strip outputs before committing"
            )


@pytest.mark.parametrize("name", RUNS)
def test_notebook_runs(name, tmp_path, monkeypatch):
    monkeypatch.delenv("FOVEAL_MODEL", raising=False)
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if name != "02_structured_output":  # 01 renders results and drawings, 03 its plots
        assert any("image/png" in o.get("data", {}) for o in outputs)
