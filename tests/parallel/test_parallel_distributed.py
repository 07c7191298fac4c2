"""Multi-host initialisation: detection from fake environments (no real init), and only the CLI initialises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dgemma.parallel.distributed import DistributedPlan, detect, expand_nodelist, maybe_initialize

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nodelist,expected", [
    ("node001", ["node001"]),
    ("node001,host2", ["node001", "host2"]),
    ("gpu-[01-03,07],cpu1", ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "cpu1"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("a[9-11]", ["a9", "a10", "a11"]),
])
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


def _slurm(**extra):
    env = {"SLURM_JOB_ID": "123456", "SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "gpu-[07-08]", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_STEP_NUM_NODES": "2"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_single_process_skips():
    assert detect({}) is None
    assert detect({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}) is None
    assert detect({"DGEMMA_COORDINATOR": "h:1", "DGEMMA_NUM_PROCESSES": "1", "DGEMMA_PROCESS_ID": "0"}) is None
    assert detect({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    assert detect(_slurm(DGEMMA_DISTRIBUTED="off")) is None


def test_slurm_one_process_per_gpu():
    plan = detect(_slurm())
    port = str(123456 % 4096 + 61440)
    assert plan == DistributedPlan("slurm", f"gpu-07:{port}", 16, 9, (1,))
    assert plan.kwargs() == {"initialization_timeout": 1800, "coordinator_address": f"gpu-07:{port}",
                             "num_processes": 16, "process_id": 9, "local_device_ids": [1]}


def test_slurm_variants():
    # one process per node: every GPU of the node stays visible (JAX's own SLURM detection would pick GPU 0 only)
    plan = detect(_slurm(SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="1(x2)"))
    assert plan.local_device_ids is None and plan.num_processes == 2
    # sbatch context without a step: the job nodelist; port overrides
    plan = detect(_slurm(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST="a[3-4],b1", DGEMMA_COORDINATOR_PORT="1234"))
    assert plan.coordinator_address == "a3:1234"
    assert detect(_slurm(JAX_COORDINATOR_PORT="777")).coordinator_address == "gpu-07:777"
    # SLURM already bound one GPU per task: no local ids
    assert detect(_slurm(CUDA_VISIBLE_DEVICES="3")).local_device_ids is None
    # tasks per node from SLURM_NTASKS / nodes when the per-node variable is absent
    assert detect(_slurm(SLURM_STEP_TASKS_PER_NODE=None)).local_device_ids == (1,)
    with pytest.raises(ValueError, match="no SLURM_\\*_NODELIST"):
        detect(_slurm(SLURM_STEP_NODELIST=None))
    with pytest.raises(ValueError, match="SLURM_NTASKS='x' must be an integer"):
        detect(_slurm(SLURM_NTASKS="x"))


def test_explicit_env_and_errors():
    env = {"DGEMMA_COORDINATOR": "10.0.0.1:1234", "DGEMMA_NUM_PROCESSES": "4", "DGEMMA_PROCESS_ID": "3",
           "DGEMMA_LOCAL_DEVICE_IDS": "0,1", "JAX_PLATFORMS": "cpu", "DGEMMA_INIT_TIMEOUT": "60"}
    plan = detect({**env, **_slurm()})  # explicit wins over SLURM
    assert plan == DistributedPlan("explicit", "10.0.0.1:1234", 4, 3, (0, 1), cpu_collectives=True, timeout_s=60)
    with pytest.raises(ValueError, match=r"\['DGEMMA_PROCESS_ID'\] missing"):
        detect({"DGEMMA_COORDINATOR": "h:1", "DGEMMA_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="must be in \\[0, DGEMMA_NUM_PROCESSES=2\\)"):
        detect({"DGEMMA_COORDINATOR": "h:1", "DGEMMA_NUM_PROCESSES": "2", "DGEMMA_PROCESS_ID": "2"})
    with pytest.raises(ValueError, match="expected auto | off | jax"):
        detect({"DGEMMA_DISTRIBUTED": "yes"})


def test_tpu_and_gke_delegate_to_jax():
    assert detect({"TPU_WORKER_HOSTNAMES": "t1,t2,t3,t4"}).method == "jax"
    assert detect({"MEGASCALE_NUM_SLICES": "2", "TPU_WORKER_HOSTNAMES": "t1"}).method == "jax"
    plan = detect({"DGEMMA_DISTRIBUTED": "jax"})
    assert plan.method == "jax" and plan.kwargs() == {"initialization_timeout": 1800}


def test_maybe_initialize_passes_the_plan_and_enables_cpu_collectives(monkeypatch):
    calls, updates = [], []
    import jax

    monkeypatch.setattr(jax.config, "update", lambda k, v: updates.append((k, v)))
    env = {"DGEMMA_COORDINATOR": "127.0.0.1:5", "DGEMMA_NUM_PROCESSES": "2", "DGEMMA_PROCESS_ID": "1",
           "JAX_PLATFORMS": "cpu"}
    plan = maybe_initialize(env, initialize=lambda **kw: calls.append(kw))
    assert plan.method == "explicit"
    assert calls == [{"initialization_timeout": 1800, "coordinator_address": "127.0.0.1:5", "num_processes": 2,
                      "process_id": 1}]
    assert updates == [("jax_cpu_collectives_implementation", "gloo")]
    assert maybe_initialize({}, initialize=lambda **kw: calls.append(kw)) is None and len(calls) == 1


def test_train_cli_initialises_before_training(monkeypatch, tmp_path):
    """`dgemma train` calls maybe_initialize after loading the config and before the loop (and --print-config
    never does)."""
    import dgemma.parallel.distributed as dist
    import dgemma.train.trainer as loop
    from dgemma.cli.main import main

    order = []
    monkeypatch.setattr(dist, "maybe_initialize", lambda *a, **k: order.append("init"))

    def fake_train(cfg, **kw):
        order.append("train")
        raise SystemExit(0)

    monkeypatch.setattr(loop, "train", fake_train)
    cfg = str(REPO / "configs/stage1/tiny.yaml")
    assert main(["train", "-c", cfg, "--print-config"]) == 0 and order == []
    with pytest.raises(SystemExit):
        main(["train", "-c", cfg, f"run.output_dir={tmp_path}"])
    assert order == ["init", "train"]


def test_no_initialisation_at_import_or_config_load():
    code = ("import json, jax\n"
            "import dgemma, dgemma.parallel, dgemma.parallel.distributed, dgemma.parallel.mesh, dgemma.cli.main\n"
            "import dgemma.cli.train, dgemma.cli.launch, dgemma.cli.plan, dgemma.train.trainer\n"
            "from dgemma.config import load_config\n"
            "load_config('configs/stage1/gemma4_26b_a4b.yaml', env={})\n"
            "from jax._src import xla_bridge\n"
            "print(json.dumps([jax.distributed.is_initialized(), xla_bridge.backends_are_initialized()]))\n")
    env = {**os.environ, "DGEMMA_COORDINATOR": "127.0.0.1:1", "DGEMMA_NUM_PROCESSES": "2", "DGEMMA_PROCESS_ID": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False]
