"""`dgemma launch`: golden renders per target, shell syntax, required fields, planner refusal, a real local run.

Golden renders live in tests/golden/launch/<case>.txt. After an intended template change, regenerate and review:

    DGEMMA_UPDATE_GOLDEN=1 python -m pytest tests/planning/test_launch.py -k golden
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dgemma.cli.main import main
from dgemma.config import load_config
from dgemma.planning.launch_spec import load_launch, topology, tpu_slice
from dgemma.planning.launcher import HOST_WRAPPER, hardware_env, read_env_file, render, render_template

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests/golden/launch"
BIG = "configs/stage1/gemma4_26b_a4b.yaml"
TINY = "configs/stage1/tiny.yaml"
SMALL_MODEL = ["model.preset=tiny", "model.num_hidden_layers=1", "model.layer_types=[full_attention]"]

CASES = {  # name -> (profile, launch overrides, config, run overrides)
    "slurm_h100_2nodes": ("slurm_h100", ["launch.nodes=2"], BIG, ["trainer.steps=100"]),
    "slurm_h100_per_device": ("slurm_h100", ["launch.process_per=device", "launch.account=proj"], BIG, []),
    "xpk_v5p64_2slices": ("xpk_v5p64", ["launch.num_slices=2"], BIG, ["mesh.dcn={data: 2}"]),
    "xpk_h100": ("xpk_h100", [], BIG, ["trainer.steps=100"]),
    "tpu_vm_v5p64": ("tpu_vm_v5p64", [], BIG, []),
    "local_cpu_4dev": ("local_cpu", [], TINY, ["mesh.ici={data: 2, fsdp: 2}", "trainer.steps=2"]),
}


def _job(name):
    profile, launch_overrides, config, overrides = CASES[name]
    cfg = load_config(REPO / config, overrides, env={})
    launch = load_launch(profile, launch_overrides)
    return render(cfg, launch, config_path=config, overrides=overrides)


def _portable(text: str) -> str:
    """A render with this machine's paths (a local launch's interpreter, packaged wrapper and working directory)
    replaced by placeholders, so that the golden files hold on any machine."""
    for path, name in ((sys.executable, "<PYTHON>"), (str(HOST_WRAPPER), "<HOST_WRAPPER>"), (str(Path.cwd()), "<CWD>")):
        text = text.replace(path, name)
    return text


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_render(name):
    text = _portable(_job(name).text())
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("DGEMMA_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing {path}; run DGEMMA_UPDATE_GOLDEN=1 pytest tests/planning/test_launch.py -k golden"
    assert text == path.read_text(), f"render of {name} changed; regenerate with DGEMMA_UPDATE_GOLDEN=1 and review"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_scripts_are_valid_bash(name, tmp_path):
    for fname, body in _job(name).files.items():
        path = tmp_path / fname
        path.write_text(body)
        out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, f"{fname}: {out.stderr}"
        assert body.startswith("#!/usr/bin/env bash\n") and "{{" not in body and "set -euo pipefail" in body


def test_static_scripts_are_valid_bash():
    for path in ["launch/host_wrapper.sh", "launch/local/train.sh"]:
        out = subprocess.run(["bash", "-n", str(REPO / path)], capture_output=True, text=True)
        assert out.returncode == 0, f"{path}: {out.stderr}"


def test_required_fields_per_target():
    slurm = _job("slurm_h100_2nodes").files["job.sbatch"]
    for needle in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                   "#SBATCH --partition=gpu", "#SBATCH --exclusive", "srun --kill-on-bad-exit=1",
                   "bash launch/host_wrapper.sh runs/stage1_gemma4_26b_a4b/logs -- python -m dgemma.cli train "
                   "--config configs/stage1/gemma4_26b_a4b.yaml trainer.steps=100 --no-progress",
                   "export XLA_FLAGS=--xla_disable_hlo_passes=constant_folding", "export NCCL_ALGO=Ring",
                   "export NCCL_PROTO=LL128", "export NCCL_NVLS_ENABLE=0", "export NCCL_CUMEM_ENABLE=0",
                   "16 x h100"]:
        assert needle in slurm, needle
    per_device = _job("slurm_h100_per_device").files["job.sbatch"]
    assert "#SBATCH --ntasks-per-node=8" in per_device and "#SBATCH --account=proj" in per_device
    xpk = _job("xpk_v5p64_2slices").files["xpk_workload.sh"]
    for needle in ["xpk workload create", "--cluster=dgemma-v5p", "--tpu-type=v5p-64", "--num-slices=2",
                   "--base-docker-image=", "DGEMMA_DISTRIBUTED=jax", "'mesh.dcn={data: 2}'", "64 x v5p"]:
        assert needle in xpk, needle
    gpu = _job("xpk_h100").files["xpk_workload.sh"]
    for needle in ["--device-type=h100-80gb-8", "--num-nodes=2", "DGEMMA_COORDINATOR=", "DGEMMA_PROCESS_ID=",
                   "NCCL_PROTO=LL128"]:
        assert needle in gpu, needle
    vm = _job("tpu_vm_v5p64").files["tpu_vm_run.sh"]
    for needle in ["gcloud compute tpus tpu-vm ssh dgemma-v5p-64", "--worker=all", "--zone=us-east5-a",
                   "cd ~/dgemma", "32 chips, 8 workers"]:
        assert needle in vm, needle
    local = _job("local_cpu_4dev").files["run.sh"]
    assert "export XLA_FLAGS=--xla_force_host_platform_device_count=4" in local
    assert "export JAX_PLATFORMS=cpu" in local


def test_hardware_env_files(tmp_path):
    _, gpu = hardware_env(load_launch(None, ["launch.accelerator=h100"]))
    assert {k: gpu[k] for k in ("XLA_FLAGS", "NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE")} == {
        "XLA_FLAGS": "--xla_disable_hlo_passes=constant_folding", "NCCL_ALGO": "Ring", "NCCL_PROTO": "LL128",
        "NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0"}
    for name in ("gpu", "tpu", "cpu"):
        label, env = hardware_env(load_launch(None, [f"launch.hardware_env={name}"]))
        assert env and label == f"hardware/{name}.env (packaged)"
    own = tmp_path / "site.env"  # a path to an .env file is read as given
    own.write_text("SITE=1\n")
    assert hardware_env(load_launch(None, [f"launch.hardware_env={own}"]))[1] == {"SITE": "1"}
    with pytest.raises(ValueError, match="launch.hardware_env: 'nope'"):
        hardware_env(load_launch(None, ["launch.hardware_env=nope"]))


def test_env_file_and_template_errors(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text("# ok\nA=1\nexport B='two words'\nnot a line\n")
    with pytest.raises(ValueError, match="bad.env:4: expected KEY=VALUE"):
        read_env_file(bad)
    bad.write_text("A=1\nexport B='two words'\n")
    assert read_env_file(bad) == {"A": "1", "B": "two words"}
    with pytest.raises(KeyError, match=r"\['nodes'\]"):
        render_template("x {{nodes}} {{a}}", {"a": 1})


def test_launch_settings_validation():
    assert tpu_slice("v5p-64") == ("v5p", 32, 8) and tpu_slice("v6e-256") == ("v6e", 256, 64)
    topo = topology(load_launch("xpk_v5p64", ["launch.num_slices=2"]))
    assert (topo.devices, topo.processes, topo.granules) == (64, 16, 2)
    assert topology(load_launch("slurm_h100", ["launch.nodes=4"])).processes == 4
    assert topology(load_launch("slurm_h100", ["launch.nodes=4", "launch.process_per=device"])).processes == 32
    from dgemma.config import ConfigError

    with pytest.raises(ConfigError, match="launch.nodez: unknown key \\(did you mean 'launch.nodes'\\?\\)"):
        load_launch("slurm_h100", ["launch.nodez=2"])
    with pytest.raises(ConfigError, match="needs the TPU VM name"):
        load_launch(None, ["launch.target=tpu-vm", "launch.accelerator=v5p", "launch.tpu_type=v5p-8"])
    with pytest.raises(ConfigError, match="needs a tpu_type"):
        load_launch(None, ["launch.target=xpk", "launch.accelerator=v5p", "launch.cluster=c"])
    with pytest.raises(ConfigError, match="expected e.g. v5p-64"):
        load_launch(None, ["launch.tpu_type=v9-1"])


def test_launch_refuses_a_run_that_does_not_fit(tmp_path, capsys):
    # without remat the activations do not fit
    argv = ["launch", "--profile", "slurm_h100", str(REPO / BIG), f"run.output_dir={tmp_path}",
            "model.execution.remat=none"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "refused: the run does not fit 8 x h100" in err and "DOES NOT FIT" in err and "activations" in err
    assert not any(tmp_path.iterdir())  # nothing written, nothing submitted
    assert main([*argv, "--force", "--dry-run"]) == 0
    assert "#SBATCH --ntasks-per-node=1" in capsys.readouterr().out
    assert main(["launch", "--profile", "slurm_h100", str(REPO / BIG), "launch.nodes=3", "--dry-run"]) == 1
    assert "not divisible" in capsys.readouterr().err  # 24 GPUs cannot hold 128 experts on fsdp


def test_launch_bad_settings_exit_2(capsys):
    assert main(["launch", "--profile", "slurm_h100", str(REPO / BIG), "launch.nodez=2", "--dry-run"]) == 2
    assert "did you mean 'launch.nodes'" in capsys.readouterr().err
    assert main(["launch", "--target", "tpu-vm", str(REPO / TINY), "--dry-run"]) == 2


def test_host_wrapper_tees_per_host_logs_and_keeps_exit_code(tmp_path):
    env = {**os.environ, "SLURM_PROCID": "5"}
    out = subprocess.run(["bash", str(REPO / "launch/host_wrapper.sh"), str(tmp_path / "logs"), "--", "bash", "-c",
                          "echo hello; echo oops >&2; exit 3"], capture_output=True, text=True, env=env)
    assert out.returncode == 3 and "hello" in out.stdout
    (log,) = (tmp_path / "logs").iterdir()
    assert log.name.endswith("-p5.log")
    text = log.read_text()
    assert "hello" in text and "oops" in text and "exit 3" in text


def test_local_target_runs_for_real(tmp_path, capsys):
    """Renders, checks with the planner, writes and runs a 2-step tiny training in a subprocess."""
    argv = ["launch", "--target", "local", str(REPO / TINY), *SMALL_MODEL, "trainer.steps=2", "optim.warmup_steps=0",
            f"run.output_dir={tmp_path}", f"launch.python={sys.executable}", "launch.env={WANDB_MODE: disabled}"]
    assert main(argv) == 0
    run_dir = tmp_path / "stage1_tiny"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2
    assert (run_dir / "launch" / "run.sh").exists() and (run_dir / "checkpoints" / "2").is_dir()
    (log,) = (run_dir / "logs").iterdir()
    assert "done: steps 0->2" in log.read_text()
    assert "FITS" in capsys.readouterr().err
