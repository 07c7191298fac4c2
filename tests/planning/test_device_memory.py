"""`dgemma train` sets up the accelerator's memory itself (the allocator variables `dgemma launch` exports) before the
JAX backend starts, and refuses a run whose planned per-device peak exceeds what the allocator allows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dgemma.planning.device_memory import allocator_variables, configure_allocator, fit_refusal, host_fit_refusal
from dgemma.planning.launcher import HARDWARE_DIR, read_env_file

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30
H100 = 79.1 * GiB  # what an H100 80GB reports


def test_fit_decision_with_given_device_memory():
    planned = int(70.2 * GiB)  # the shipped 26B stage-1 config on 8 x H100
    refusal = fit_refusal(planned, int(0.75 * H100), "8 x NVIDIA H100 80GB HBM3")  # JAX's default preallocation
    assert refusal is not None and "70.2 GiB per device" in refusal and "59.3 GiB" in refusal
    assert "--force" in refusal and "\n" not in refusal
    assert fit_refusal(planned, int(0.95 * H100), "8 x H100") is None  # the launch wrapper's fraction
    assert fit_refusal(10, 10, "x") is None


def test_allocator_variables_are_the_launch_wrappers():
    gpu_env = read_env_file(HARDWARE_DIR / "gpu.env")
    assert allocator_variables() == {"XLA_PYTHON_CLIENT_MEM_FRACTION": gpu_env["XLA_PYTHON_CLIENT_MEM_FRACTION"]}
    env = {"PATH": "/bin"}
    assert configure_allocator(env) == allocator_variables() and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert configure_allocator(mine) == {} and mine["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"  # the user's wins


PROBE = """
import os, sys
from dgemma.cli.main import main
rc = main(["train", "--config", sys.argv[1], "--print-config"])
print("FRACTION", os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), "JAX_IMPORTED", "jax" in sys.modules, "RC", rc)
"""


def _probe(env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")} | env_extra
    out = subprocess.run([sys.executable, "-c", PROBE, str(REPO / "configs/stage1/tiny.yaml")], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip().splitlines()[-1]


def test_dgemma_train_sets_the_fraction_before_jax_starts():
    assert _probe({}) == "FRACTION 0.95 JAX_IMPORTED False RC 0"
    assert _probe({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"}) == "FRACTION 0.6 JAX_IMPORTED False RC 0"


def test_cpu_is_not_checked():
    from dgemma.config import load_config
    from dgemma.planning.device_memory import run_fit_refusal

    assert run_fit_refusal(load_config(REPO / "configs/stage1/tiny.yaml", env={})) is None


def test_host_fit_decision():
    refusal = host_fit_refusal(int(94.1 * GiB), int(57.6 * GiB), 8)  # stage 2's pinned reference on a 64 GiB node
    assert "94.1 GiB" in refusal and "57.6 GiB" in refusal and "8 devices" in refusal and "--force" in refusal
    assert host_fit_refusal(int(94.1 * GiB), int(1843.2 * GiB), 8) is None
    assert host_fit_refusal(10, None, 8) is None  # nothing kept on the host / CPU


def test_train_prints_how_the_global_batch_splits():
    """`dgemma train` prints one line at its start: the global batch, rows per process, the per-device micro-batch
    and the (derived) accumulation."""
    from dgemma.cli.train import batch_line
    from dgemma.config import load_config

    tiny = REPO / "configs/stage1/tiny.yaml"
    line = batch_line(load_config(tiny, ["data.batch_size=16", "trainer.grad_accum_steps=0",
                                         "mesh.ici={data: 1, fsdp: 4, expert: 1, tensor: 1}"], env={}))
    assert line == ("global batch 16 (data.batch_size) = 1 processes x 16 rows; 1 examples per device per "
                    "micro-batch x grad_accum 4 over 4 batch shards")
    assert "x grad_accum 2 over 4" in batch_line(load_config(tiny, ["data.batch_size=16", "trainer.grad_accum_steps=2",
                                                                   "mesh.ici={data: 1, fsdp: 4, expert: 1, tensor: 1}"],
                                                             env={}))
