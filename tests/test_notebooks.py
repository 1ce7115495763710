"""Executes every notebook in ``notebooks/`` (small mode) on this interpreter's kernel."""

import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

from jupyter_client.manager import KernelManager  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def execute(path: Path):
    """Runs ``path`` with ``DDL_NOTEBOOK_SMALL=1``; a cell that raises fails the test."""
    nb = nbformat.read(path, as_version=4)
    manager = KernelManager(kernel_name="python3")
    # the python3 kernel on this interpreter (the venv's), whatever kernelspec is installed
    manager.kernel_spec.argv = [
        sys.executable,
        "-m",
        "ipykernel_launcher",
        "-f",
        "{connection_file}",
    ]
    client = nbclient.NotebookClient(
        nb,
        km=manager,
        kernel_name="python3",
        timeout=120,
        resources={"metadata": {"path": str(path.parent)}},
    )
    with pytest.MonkeyPatch.context() as mp:
        # the kernel inherits this environment: small mode, CPU devices
        mp.setenv("DDL_NOTEBOOK_SMALL", "1")
        mp.setenv("JAX_PLATFORMS", "cpu")
        client.execute()
    return nb


def test_there_are_notebooks():
    assert len(NOTEBOOKS) == 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    nb = execute(path)
    streams = [
        (output.get("name"), output.get("text", ""))
        for cell in nb.cells
        for output in cell.get("outputs", [])
    ]
    # no warning in the outputs (tqdm's "IProgress not found" without ipywidgets, say)
    warnings = [text for name, text in streams if name == "stderr" and "Warning" in text]
    assert not warnings, warnings
    # a comparison prints a line per strategy, not one per logged step
    assert max(text.count("\n") for _, text in streams) < 60, path
    if path.stem.startswith("02_"):
        texts, images = [], 0
        for cell in nb.cells:
            for output in cell.get("outputs", []):
                texts.append(output.get("text", ""))
                texts.append(output.get("data", {}).get("text/plain", ""))
                images += "image/png" in output.get("data", {})
        text = "".join(texts)
        assert "| strategy" in text and "topk:0.01" in text, text[-2000:]
        assert images >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_use_only_the_public_api(path):
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "code")
    assert "ddl_jax._src" not in code


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_first_cell_installs_from_a_source_the_user_names(path):
    nb = nbformat.read(path, as_version=4)
    first = next(cell.source for cell in nb.cells if cell.cell_type == "code")
    assert "%pip install ddl-jax" not in first  # not on PyPI: it could never succeed
    assert "%pip install {source}" in first and "DDL_JAX_SOURCE" in first
