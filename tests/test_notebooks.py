"""Every notebook runs top to bottom (CPU, committed reports) without an error."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the test extra brings nbformat and nbclient")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert outputs and not any(o.get("output_type") == "error" for o in outputs)
