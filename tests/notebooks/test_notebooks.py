"""The notebooks run top to bottom on CPU (small shapes), and the repository keeps them without outputs."""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 180


def test_the_five_notebooks_exist():
    stems = [p.stem for p in NOTEBOOKS]
    for prefix in ["01_quickstart", "02_playground", "03_block_sparsity", "04_gallery_tour", "05_benchmark"]:
        assert prefix in stems, f"missing notebooks/{prefix}.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_are_stripped(path):
    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for index, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} cell {index} has outputs; clear them before committing "
                "(jupyter nbconvert --clear-output --inplace notebooks/*.ipynb)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_cpu(path, monkeypatch):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    # The kernel is a subprocess: make it import this checkout's flexlab and keep it on the CPU.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    book = nbformat.read(path, as_version=4)
    client = NotebookClient(book, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    try:
        client.execute()
    except CellExecutionError as err:
        pytest.fail(f"{path.name} failed:\n{str(err)[-3000:]}")
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors
    assert all(c.execution_count for c in book.cells if c.cell_type == "code" and c.source.strip())


PUBLIC_MODULES = ("flexlab", "flexlab.gallery", "flexlab.viz", "flexlab.viz.source_view", "flexlab.testing",
                  "flexlab.bench.report")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_use_the_public_api(path):
    """Notebooks are documentation: they import public modules and touch no private names."""
    import re

    book = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in book.cells if c.cell_type == "code")
    for module in re.findall(r"^\s*(?:from|import)\s+(flexlab[\w.]*)", code, flags=re.M):
        assert module in PUBLIC_MODULES, f"{path.name} imports {module}"
    assert not re.search(r"flexlab\.[\w.]*\b_[a-z]", code), f"{path.name} uses a private flexlab name"
