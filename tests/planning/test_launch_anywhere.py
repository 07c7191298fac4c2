"""`dgemma launch --target local` as an installed command: from a directory outside the checkout,
without an activated environment (no `python` of the venv on PATH), and a launch that cannot start leaves nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.cli_errors import one_line_error
from dgemma.cli.main import main
from dgemma.planning.launcher import HOST_WRAPPER

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")
SMALL_RUN = ["model.preset=tiny", "model.num_hidden_layers=1", "model.layer_types=[full_attention]",
             "trainer.steps=2", "optim.warmup_steps=0", "launch.env={WANDB_MODE: disabled}"]


def _dgemma() -> list[str]:
    """The venv's `dgemma` console script by full path (as a user runs path/to/venv/bin/dgemma)."""
    script = Path(sys.executable).parent / "dgemma"
    return [str(script)] if script.exists() else [sys.executable, "-m", "dgemma"]


def test_local_launch_from_outside_the_checkout_without_the_venv_on_path(tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DGEMMA_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = "/usr/bin:/bin"  # no python with jax on it: the job must run the interpreter dgemma runs in
    proc = subprocess.run([*_dgemma(), "launch", "--target", "local", TINY, *SMALL_RUN, "run.output_dir=runs"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run_dir = work / "runs" / "stage1_tiny"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2
    script = (run_dir / "launch" / "run.sh").read_text()
    assert f"cd {work}\n" in script and f"-- {Path(sys.executable).parent}/python" in script, script  # the venv's
    (log,) = (run_dir / "logs").iterdir()
    assert "done: steps 0->2" in log.read_text()


def test_a_local_launch_that_cannot_start_leaves_nothing(tmp_path, capsys):
    out = tmp_path / "runs"
    # an interpreter that does not exist: refused before anything is written
    assert main(["launch", "--target", "local", TINY, *SMALL_RUN, f"run.output_dir={out}",
                 f"launch.python={tmp_path / 'no' / 'python'}"]) == 2
    one_line_error(capsys, "launch.python", str(tmp_path / "no" / "python"), "not an executable")
    assert not out.exists()
    # a setup line that is not a command: the script fails before the run starts (bash: 127); what the launch
    # wrote (the run dir with its script and log dir) is removed again
    assert main(["launch", "--target", "local", TINY, *SMALL_RUN, f"run.output_dir={out}",
                 "launch.setup=[no_such_command_for_dgemma_tests]"]) == 1
    assert "could not start (exit 127" in capsys.readouterr().err
    assert not out.exists()


def test_the_host_wrapper_is_package_data():
    assert HOST_WRAPPER.is_file() and HOST_WRAPPER.parent.name == "planning"
    assert '"host_wrapper.sh"' in (REPO / "pyproject.toml").read_text()
    assert (REPO / "launch/host_wrapper.sh").resolve() == HOST_WRAPPER.resolve()  # the checkout's path links to it
