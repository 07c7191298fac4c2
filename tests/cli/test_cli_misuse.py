"""The CLI under misuse : nothing is deleted or silently kept, errors are one line with a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from support.cli_errors import one_line_error as _one_line_error
from dgemma.cli.main import main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run dir as `dgemma train` leaves it: checkpoints/, params/<step>/, metrics.jsonl (random tiny_toy weights)."""
    from dgemma.checkpoint import save_params
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer

    root = tmp_path_factory.mktemp("runs") / "v"
    cfg = load_config(TINY, [], env={})
    save_params(root / "params", 4, nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(0)), nnx.Param))
    (root / "checkpoints" / "4").mkdir(parents=True)
    (root / "metrics.jsonl").write_text('{"step": 4}\n')
    return root


def test_export_overwrite_never_deletes_the_run_dir(run_dir, tmp_path, capsys):
    before = sorted(p.name for p in run_dir.iterdir())
    assert main(["export", "-c", TINY, "--checkpoint", str(run_dir / "params"), "--out", str(run_dir),
                 "--overwrite"]) == 2
    _one_line_error(capsys, "contains the source")
    other = tmp_path / "not_an_export"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert main(["export", "-c", TINY, "--checkpoint", str(run_dir / "params"), "--out", str(other),
                 "--overwrite"]) == 2
    _one_line_error(capsys, "replaces only a previous export")
    assert sorted(p.name for p in run_dir.iterdir()) == before and (other / "notes.txt").exists()


def test_export_argument_errors_before_writing(run_dir, tmp_path, capsys):
    common = ["export", "-c", TINY, "--checkpoint", str(run_dir / "params")]
    assert main([*common, "--out", str(tmp_path / "a"), "--tokenizer-dir", str(tmp_path / "missing")]) == 2
    _one_line_error(capsys, "--tokenizer-dir", "no such directory")
    assert main([*common, "--out", str(tmp_path / "b"), "--max-shard-size", "0"]) == 2
    _one_line_error(capsys, "--max-shard-size 0")
    assert main([*common, "--out", str(tmp_path / "c"), "--fp8", "--fp8-block", "0x64"]) == 2
    _one_line_error(capsys, "--fp8-block")
    assert list(tmp_path.iterdir()) == []


def test_convert_into_an_existing_out_refuses_or_replaces_whole(run_dir, tmp_path, capsys):
    from dgemma.checkpoint import restore_params
    from dgemma.config import load_config
    from dgemma.convert.hf_export import export_hf
    from dgemma.model.transformer import Transformer

    cfg = load_config(TINY, [], env={})
    a, b = (Transformer(cfg.model_config, rngs=nnx.Rngs(s)) for s in (1, 2))
    hf_a = export_hf(a, tmp_path / "hf_a", layout="gemma4", dtype="float32")
    hf_b = export_hf(b, tmp_path / "hf_b", layout="gemma4", dtype="float32")
    out = tmp_path / "params"
    assert main(["convert", "-c", TINY, "--hf", str(hf_a), "--out", str(out)]) == 0
    capsys.readouterr()
    # the run config's mesh is the one used: a mesh this host cannot form is refused (it was silently fsdp=all)
    assert main(["convert", "-c", TINY, "mesh.ici.data=16", "--hf", str(hf_a), "--out", str(tmp_path / "m")]) == 1
    _one_line_error(capsys, "mesh.ici")
    assert not (tmp_path / "m").exists()
    assert main(["convert", "-c", TINY, "--hf", str(hf_b), "--out", str(out)]) == 2
    _one_line_error(capsys, "exists", "--overwrite")
    # a training params/ dir with more than step dirs, or the source inside --out: refused even with --overwrite
    assert main(["convert", "-c", TINY, "--hf", str(hf_b), "--out", str(run_dir), "--overwrite"]) == 2
    _one_line_error(capsys, "refusing")
    assert main(["convert", "-c", TINY, "--hf", str(hf_b), "--out", str(out), "--overwrite"]) == 0
    assert [p.name for p in out.iterdir()] == ["0"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    import jax

    want = nnx.state(b, nnx.Param)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want)
    got = restore_params(out, target)
    np.testing.assert_array_equal(np.asarray(got["embedder"]["embedding"][...]),
                                  np.asarray(want["embedder"]["embedding"][...]))


def test_sample_and_eval_input_errors_are_one_line(run_dir, tmp_path, capsys):
    ckpt = str(run_dir / "params")
    mesh = "mesh.ici={fsdp: -1}"  # all the (simulated) devices
    sample = ["sample", "-c", TINY, mesh, "--prompt", "C12|"]
    empty = tmp_path / "empty"
    empty.mkdir()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for path, needle in ((tmp_path / "missing", "does not exist"), (empty, "no params checkpoint"),
                         (hf, "a Hugging Face checkpoint")):
        assert main([*sample, "--checkpoint", str(path)]) == 2
        _one_line_error(capsys, str(path), needle)
    assert main([*sample, "--checkpoint", ckpt, "model.num_experts=4"]) == 2  # shapes differ from the checkpoint
    _one_line_error(capsys, "cannot restore the config's model")
    assert main(["sample", "-c", TINY, mesh, "--checkpoint", ckpt, "--prompt-file",
                 str(tmp_path / "nope.txt")]) == 1
    _one_line_error(capsys, "nope.txt")
    assert main(["sample", "-c", TINY, mesh, "--checkpoint", ckpt, "--prompt", "C12é|"]) == 2
    _one_line_error(capsys, "prompt:", "é")
    # the prompt plus the generation budget must fit the model's positions
    assert main(["sample", "-c", TINY, mesh, "--checkpoint", ckpt, "--prompt", "C12|" * 600]) == 2
    _one_line_error(capsys, "> model.max_position_embeddings=1024")
    for flag in ("--batches", "--batch-size"):
        assert main(["eval", "-c", TINY, mesh, "--checkpoint", ckpt, flag, "0"]) == 2
        _one_line_error(capsys, f"{flag} 0: must be >= 1")
    assert main(["sample", "-c", TINY, "--prompt", "C12|", "--checkpoint", ckpt, "mesh.ici={fsdp: 64}"]) != 0
    _one_line_error(capsys, "64")


def test_config_and_init_from_errors_before_compiling(tmp_path, capsys):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("run: {name: caf\xe9}\n".encode("latin-1"))
    assert main(["plan", str(bad)]) == 2
    _one_line_error(capsys, "latin1.yaml", "not UTF-8")
    out = ["run.output_dir=" + str(tmp_path / "runs")]
    assert main(["train", "-c", TINY, "--no-progress", f"checkpoint.init_from={tmp_path / 'nope'}", *out]) == 2
    _one_line_error(capsys, "checkpoint.init_from", "does not exist")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert main(["train", "-c", TINY, "--no-progress", f"checkpoint.init_from={hf}", *out]) == 2
    _one_line_error(capsys, "dgemma convert")
    assert not (tmp_path / "runs").exists()  # nothing left behind
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    assert main(["plan", TINY, "--out", str(blocker / "sub")]) != 0  # an unwritable --out
    _one_line_error(capsys, "file.txt")


# MARK: Misuse that used to be accepted silently: an empty config file, FP8 flags without --fp8, more processes than ----------
REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")
TINY2 = str(REPO / "configs/stage2/tiny.yaml")
STAGE1_TOY = str(REPO / "experiments/sdrl_study/checkpoint/stage1_toy")
ALL_DEVICES = "mesh.ici={fsdp: -1}"  # the tiny configs' one-device mesh would be refused first on a multi-device host


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# MARK: empty config file -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n  # and another\n", "---\n"])
def test_an_empty_config_file_is_refused_naming_it(text, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default run dir (runs/dgemma) would land here
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    # trainer.steps=1: were the file accepted, the default run would be short, not 1,000 steps
    assert main(["train", "-c", str(empty), "--no-progress", "trainer.steps=1"]) == 2
    _one_line_error(capsys, str(empty), "empty")
    assert _tree(tmp_path) == ["empty.yaml"]


def test_an_empty_base_file_is_refused_and_a_base_only_config_loads(tmp_path, capsys):
    from dgemma.config import ConfigError, load_config

    (tmp_path / "empty_base.yaml").write_text("# nothing\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: empty_base.yaml\ntrainer: {steps: 3}\n")
    with pytest.raises(ConfigError, match="empty_base.yaml: the config file is empty"):
        load_config(child, env={})
    only_base = tmp_path / "only_base.yaml"
    only_base.write_text(f"base: {TINY}\n")
    assert load_config(only_base, env={}) == load_config(TINY, env={})


# MARK: export ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, named", [
    (["--fp8-block", "64"], ["--fp8-block", "needs --fp8"]),
    (["--fp8-allow-partial-blocks"], ["--fp8-allow-partial-blocks", "needs --fp8"]),
    (["--fp8-block", "64", "--fp8-allow-partial-blocks"], ["--fp8-block and --fp8-allow-partial-blocks", "--fp8"]),
])
def test_fp8_options_without_fp8_are_refused(flags, named, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", "-c", TINY, "--checkpoint", str(tmp_path / "params"), "--out", str(out), *flags]) == 2
    _one_line_error(capsys, *named)
    assert not out.exists()


# MARK: plan --processes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, overrides, needles", [
    (["--processes", "16", "--devices", "8"], [], ["--processes 16 is more than the 8 devices", "--devices 8"]),
    (["--processes", "3", "--devices", "8"], [], ["--processes 3 does not divide the 8 devices"]),
    (["--processes", "4"], ["mesh.ici={data: 2}"], ["--processes 4 is more than the 2 devices", "mesh"]),
])
def test_plan_refuses_processes_that_cannot_share_the_devices(flags, overrides, needles, tmp_path, capsys):
    out = tmp_path / "prov"
    assert main(["plan", "-c", TINY, *flags, "--out", str(out), *overrides]) == 2
    _one_line_error(capsys, *needles)
    assert not out.exists()
    capsys.readouterr()
    assert main(["plan", "-c", TINY, "--processes", "2", "--devices", "4", "--out", str(out),
                 "mesh.ici={data: 2, fsdp: 2}"]) == 0
    assert (out / "resolved_config.yaml").exists()


# MARK: launch --target slurm of a CPU run -------------------------------------------------------------------------
def test_slurm_render_of_a_cpu_launch_requests_no_gpus(tmp_path, capsys):
    run_dir = tmp_path / "runs"
    argv = ["launch", "--target", "slurm", TINY, "--dry-run", f"run.output_dir={run_dir}", "mesh.ici={data: 2, fsdp: 2}"]
    assert main(argv) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=1" in script and "gpus" not in script.lower()
    # the one process of the node simulates the mesh's 4 CPU devices, as a local launch does
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in script and "JAX_PLATFORMS=cpu" in script
    assert not run_dir.exists()  # --dry-run writes nothing
    # one process per device: each process has its one CPU device, no simulated-device flag
    assert main([*argv, "launch.process_per=device"]) == 0
    script = capsys.readouterr().out
    assert "--ntasks-per-node=4" in script and "xla_force_host_platform_device_count" not in script
    assert "gpus" not in script.lower()


@pytest.mark.parametrize("target, extra, needle", [
    ("xpk", ["launch.cluster=c"], "launch.accelerator: target xpk runs on GKE TPU or GPU nodes, not cpu"),
    ("tpu-vm", ["launch.tpu_name=t"], "launch.accelerator: target tpu-vm runs on TPU VMs, not cpu"),
])
def test_cloud_targets_of_a_cpu_launch_are_refused(target, extra, needle, tmp_path, capsys):
    run_dir = tmp_path / "runs"
    assert main(["launch", "--target", target, TINY, "--dry-run", f"run.output_dir={run_dir}", *extra]) == 2
    _one_line_error(capsys, needle)
    assert not run_dir.exists()


# MARK: optim.warmup_steps longer than the run ----------------------------------------------------------------------
def test_train_refuses_a_warmup_longer_than_the_run(tmp_path, capsys):
    out = tmp_path / "runs"
    # tiny.yaml warms up over 20 updates; a 2-step run never reaches optim.lr
    assert main(["train", "-c", TINY, "--no-progress", ALL_DEVICES, "trainer.steps=2", f"run.output_dir={out}"]) == 2
    _one_line_error(capsys, "optim.warmup_steps=20 exceeds the 2 optimizer updates")
    assert not out.exists()


def test_sdrl_warmup_is_checked_against_every_inner_update(tmp_path, capsys):
    """sdrl makes trainer.steps x sdrl.inner_epochs x sdrl.num_minibatches optimizer updates (here 1 x 2 x 2)."""
    out = tmp_path / "runs"
    argv = ["train", "-c", TINY2, "--no-progress", "trainer.steps=1", "sdrl.inner_epochs=2", "sdrl.num_minibatches=2",
            ALL_DEVICES, "data.batch_size=8", "sdrl.group_size=2", f"checkpoint.init_from={STAGE1_TOY}", f"run.output_dir={out}"]
    assert main([*argv, "optim.warmup_steps=5"]) == 2
    _one_line_error(capsys, "optim.warmup_steps=5 exceeds the 4 optimizer updates")
    assert not out.exists()


@pytest.mark.parametrize("command", [["plan"], ["launch", "--target", "slurm", "--dry-run"]])
def test_plan_and_launch_refuse_a_warmup_longer_than_the_run_before_writing(command, tmp_path, capsys):
    out = tmp_path / "out"
    extra = ["--out", str(out)] if command == ["plan"] else [f"run.output_dir={out}"]
    assert main([*command, TINY, "trainer.steps=5", *extra]) == 2
    _one_line_error(capsys, "optim.warmup_steps=20 exceeds the 5 optimizer updates")
    assert not out.exists()
    # sdrl counts trainer.steps x sdrl.inner_epochs x sdrl.num_minibatches updates: 2 x 2 x 5 = 20 fits
    sdrl = [TINY2, "trainer.steps=2", "sdrl.num_minibatches=5", *extra]
    assert main([*command, *sdrl, "optim.warmup_steps=20"]) == 0
    capsys.readouterr()
    assert main([*command, *sdrl, "optim.warmup_steps=21"]) == 2
    _one_line_error(capsys, "optim.warmup_steps=21 exceeds the 20 optimizer updates")
