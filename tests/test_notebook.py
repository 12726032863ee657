"""notebooks/quickstart.ipynb runs top to bottom (in its tiny setting) and draws its loss curve and table."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("NEUROADA_QUICKSTART_TINY", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": tmp_path}}).execute()

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    assert any("image/png" in output.get("data", {}) for output in outputs), "no loss curve was drawn"
    tables = [output["data"]["text/markdown"] for output in outputs if "text/markdown" in output.get("data", {})]
    assert tables and "| **average** |" in tables[0]
    assert (tmp_path / "outputs" / "quickstart" / "adapter" / "adapter_config.json").is_file()
    assert "gold answer:" in "".join(output.get("text", "") for output in outputs)
