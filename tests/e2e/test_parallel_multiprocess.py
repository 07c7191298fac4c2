"""Real multi-process training on CPU: 2 OS processes x 2 simulated devices on loopback vs 1 process x 4 devices.

Both go through the CLI (`python -m dgemma.cli train`), so the multi-process side exercises
`dgemma.parallel.distributed.maybe_initialize` (explicit DGEMMA_COORDINATOR / DGEMMA_NUM_PROCESSES /
DGEMMA_PROCESS_ID, gloo CPU collectives), per-process data slices assembled into global arrays, and orbax checkpoints
written and restored by all processes: the 2-process run trains 2 steps, exits, and a second 2-process launch resumes
from its checkpoint to step 4; its periodic evaluation decodes the held-out rows split over both processes. Same global batch (data.batch_size=8: 4 rows per process x 2), mesh data=2 x fsdp=2,
AR objective (no noise, so the per-step losses must agree up to float summation order). A 1-layer tiny model keeps compilation short;
all runs share a persistent compilation cache.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from support import fast_xla

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "trainer.objective=ar", "model.preset=tiny", "model.vocab_size=32", "model.num_hidden_layers=1",
    "model.layer_types=[full_attention]", "mesh.ici={data: 2, fsdp: 2}", "optim.schedule=constant",
    "optim.warmup_steps=0", "trainer.log_every=1", "checkpoint.every=2", "run.name=mp", "data.num_threads=0",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path, devices: int, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGEMMA_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=fast_xla.xla_flags(f"--xla_force_host_platform_device_count={devices}"),
               JAX_COMPILATION_CACHE_DIR=str(tmp / "xla_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", WANDB_MODE="disabled", **extra)
    return env


def _cmd(out: Path, steps: int, batch: int) -> list[str]:
    return [sys.executable, "-m", "dgemma.cli", "train", "-c", "configs/stage1/tiny.yaml", *OVERRIDES,
            f"run.output_dir={out}", f"trainer.steps={steps}", f"data.batch_size={batch}", "--no-progress"]


def _two_processes(tmp: Path, out: Path, steps: int, also: list | None = None) -> list[str]:
    """Run the 2-process job (plus `also`, already started Popens, waited for with it); returns the 2 logs."""
    port = _free_port()
    procs = [subprocess.Popen(_cmd(out, steps, 8), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=_env(tmp, 2, DGEMMA_COORDINATOR=f"127.0.0.1:{port}",
                                                  DGEMMA_NUM_PROCESSES="2", DGEMMA_PROCESS_ID=str(i)))
             for i in range(2)]
    procs += also or []
    logs = []
    try:
        for p in procs:
            # a hang guard, not a speed check: under -n 2 beside a heavy test one run took > 150 s in CI
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return logs[:2]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run_dir)}


def _evaluation(run_dir: Path, step: int) -> dict[str, float]:
    """The periodic evaluation logged at `step` (the loop evaluates at the run's last step)."""
    return {k: v for r in _rows(run_dir) if r["step"] == step for k, v in r.items() if k.startswith("eval/")}


def _evaluation_in_this_process(run_dir: Path, step: int) -> dict[str, float]:
    """The run's periodic evaluation of its saved `step` params, in this one process, on the run's mesh."""
    from flax import nnx

    from dgemma.cli import common
    from dgemma.config import load_config
    from dgemma.parallel.mesh import use_mesh
    from dgemma.train.periodic_eval import PeriodicEval

    cfg = load_config(run_dir / "resolved_config.yaml", env={})
    model, params = common.restore_model(cfg, str(run_dir / "params" / str(step)))
    mesh = common.run_mesh(cfg.mesh)
    with use_mesh(mesh):
        return PeriodicEval(cfg, nnx.graphdef(model), mesh=mesh)(params, step)


@pytest.mark.multiprocess
def test_two_process_training_with_resume_matches_single_process(tmp_path):
    single = subprocess.Popen(_cmd(tmp_path / "single", 4, 8), cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env(tmp_path, 4))
    multi = tmp_path / "multi"
    logs = _two_processes(tmp_path, multi, 2, also=[single])  # the reference runs alongside the first phase
    assert all("steps 0->2" in log for log in logs)
    assert sorted(p.name for p in (multi / "mp" / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    logs = _two_processes(tmp_path, multi, 4)  # a fresh pair of processes restores step 2 and continues
    assert all("steps 2->4" in log for log in logs), logs[0][-2000:]
    want, got = _losses(tmp_path / "single" / "mp"), _losses(multi / "mp")
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [want[s] for s in range(1, 5)], rtol=2e-5)
    assert len({round(v, 3) for v in want.values()}) == 4  # the loss moves, so a frozen run could not pass
    # the periodic evaluation at step 4: the sampler decoded its held-out batch split over the mesh, which spans both
    # processes there (each places its own devices' rows). It logs what the single process logs...
    got = _evaluation(multi / "mp", 4)
    assert sorted(got) == sorted(_evaluation(tmp_path / "single" / "mp", 4)) and got["eval/diffusion/n"] == 16
    # ...and decodes what one process decodes from the same step-4 params (the two runs' params differ in fp32
    # summation order, which may flip a near-tie of the sampler, so the reference evaluates the saved params here)
    here = _evaluation_in_this_process(multi / "mp", 4)
    assert got == pytest.approx(here, rel=1e-5)
    sampled = sorted(k for k in got if k.startswith("eval/diffusion/"))
    assert [got[k] for k in sampled] == [here[k] for k in sampled] and got["eval/diffusion/tokens"] > 0
