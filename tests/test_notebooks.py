"""Notebooks are jupytext percent scripts, executed here as real notebooks (jupytext -> nbformat -> nbclient, one
Jupyter kernel per notebook), so what is checked is what a reader sees: every code cell runs in order in a kernel,
no cell raises, and the notebook shows results (stream / display outputs). Tiny preset, CPU.

Needs the `notebooks` extra (jupytext, nbclient, ipykernel); `.ci/run` installs it.
"""

from pathlib import Path

import signal

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.py"))


# Every notebook runs here at its own defaults, as a reader opens it. The SD·RL study notebook's default is the
# reduced study (1 seed, copy + sort, 4 iterations from the shipped copy/sort stage-1 checkpoint, 12 held-out prompts
# per task) and asserts the direction of change on copy: fewer steps per block, EM within 5 points (~3 min on the
# 2-core CI runner). `DGEMMA_SDRL_REGIME=choice` runs the many-answer regime (pick + fill) instead.
# `DGEMMA_SDRL_BUDGET=smoke` runs the same cells at a smoke budget (plumbing only).
PARAMS = [pytest.param(p, {}, id=p.stem) for p in NOTEBOOKS] + [
    pytest.param(REPO / "notebooks" / "sdrl_study.py", {"DGEMMA_SDRL_BUDGET": "smoke"}, id="sdrl_study-smoke",
                 marks=pytest.mark.slow)]


@pytest.mark.parametrize("path, env", PARAMS)
def test_notebook_executes(path, env, tmp_path, monkeypatch):
    jupytext = pytest.importorskip("jupytext", reason="notebooks extra (jupytext, nbclient, ipykernel)")
    nbclient = pytest.importorskip("nbclient", reason="notebooks extra (jupytext, nbclient, ipykernel)")
    import nbformat

    nb = jupytext.read(path)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert code_cells, f"{path.name}: no code cells (is it a jupytext percent script?)"
    # The kernel inherits this process's environment (XLA_FLAGS, JAX_PLATFORMS, the session's compilation cache, the
    # budget above) and runs from the repository root, as the script version did (notebooks name configs by path).
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # what the notebook writes to a temp dir goes with the test's tmp_path
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    # The kernel manager installs Python's default SIGINT handler in this process; a run started in the background
    # (SIGINT ignored, as `cmd &` does) would otherwise see its handler changed by this test.
    sigint = signal.getsignal(signal.SIGINT)
    try:
        client.execute()  # raises CellExecutionError naming the cell on any error
    finally:
        signal.signal(signal.SIGINT, sigint)
    nbformat.write(nb, tmp_path / f"{path.stem}.ipynb")  # the executed notebook, outputs included
    outputs = [o for c in code_cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert [o for o in outputs if o.output_type in ("stream", "display_data", "execute_result")], (
        f"{path.name}: a notebook should show its results")
