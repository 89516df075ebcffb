"""Every notebook runs headless, top to bottom, without errors."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
FIGURES = {"default_pair.ipynb": "acceptance.png", "paged_attention.ipynb": "paged_attention.png",
           "disaggregated.ipynb": "disaggregated.png"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("NOTEBOOK_QUICK", "1")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert (tmp_path / FIGURES[path.name]).exists()


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ has no .ipynb"
    assert {p.name for p in NOTEBOOKS} == set(FIGURES), "name each notebook's figure in FIGURES"
