"""Checkpoint faults, each on real files (no mocks): a corrupt latest step (truncated / removed files) falls back to the
newest intact step and is moved aside; a full disk is one `CheckpointWriteError` with the temporary directory removed
and the last good step intact; a changed model is one `CheckpointMismatchError` naming the first differing path; the
same for params-only checkpoints; and `dgemma train` resumes past a truncated latest checkpoint, and stops with one
line and exit code 1 on a full disk.

The disk-full cases run in a subprocess of this file's script mode (`python tests/checkpoint/test_checkpoint_faults.py
disk-full DIR`) that lowers its own RLIMIT_FSIZE with SIGXFSZ ignored, so every write past the limit fails with EFBIG,
exactly as ENOSPC does on a full disk.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs/stage1/tiny.yaml")


# MARK: a small train state ------------------------------------------------------------------------------------------
def _state(experts=8, extra_layer=False, seed=0, step=1):
    """(state, abstract target with shardings): the TrainState of a 2-3 parameter model on a 2-device mesh."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dgemma.config import load_config
    from dgemma.model.layers import param
    from dgemma.parallel.mesh import make_mesh
    from dgemma.train.optim import build_optimizer
    from dgemma.train.state import abstract_train_state, init_train_state, train_state_shardings, with_shardings

    class Small(nnx.Module):
        def __init__(self, rngs):
            self.embed = param(rngs, (16, 8), ("vocab", "embed"), jnp.float32)
            self.experts = param(rngs, (experts, 8, 4), ("exp", "embed", "exp_mlp"), jnp.float32)
            if extra_layer:
                self.extra = param(rngs, (8,), ("embed",), jnp.float32, init="ones")

    mesh = make_mesh({"fsdp": 2}, jax.devices()[:2])
    opt = build_optimizer(load_config(None, {"optim.lr": 1e-2}, env={}).optim, total_steps=10)
    _, abstract = abstract_train_state(Small, opt.tx, seed)
    sh = train_state_shardings(abstract, opt.tx, mesh, "fsdp")
    _, state = init_train_state(Small, opt.tx, seed, sh)
    return state.replace(step=jnp.asarray(step, jnp.int32)), with_shardings(abstract, sh)


def _save_steps(directory, steps, state):
    import jax.numpy as jnp

    from dgemma.checkpoint import CheckpointManager

    with CheckpointManager(directory, async_save=False) as ckpt:
        for s in steps:
            ckpt.save(s, state.replace(step=jnp.asarray(s, jnp.int32)), data_state={"step": s})


def _truncate_data_files(step_dir: Path) -> int:
    """Truncate every OCDBT data file of a step to half its size (what a crash of the storage layer leaves)."""
    files = [f for f in step_dir.rglob("*") if f.is_file() and f.parent.name == "d"]
    for f in files:
        os.truncate(f, f.stat().st_size // 2)
    return len(files)


def _remove_manifests(step_dir: Path) -> int:
    files = list(step_dir.rglob("manifest.ocdbt"))
    for f in files:
        f.unlink()
    return len(files)


@pytest.fixture
def stray_reports(monkeypatch):
    """Python's "Exception ignored" reports during the test (plus what a collection and a short wait bring): orbax's
    abandoned reads after a failed one must not reach stderr as tracebacks."""
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)

    def collect():
        time.sleep(0.2)
        gc.collect()
        return [f"{type(r.exc_value).__name__}: {r.exc_value}" for r in reports]

    return collect


def _empty_iterator_json(step_dir: Path) -> int:
    os.truncate(step_dir / "data" / "iterator.json", 0)
    return 1


# MARK: corrupt steps --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", [_truncate_data_files, _remove_manifests, _empty_iterator_json])
def test_corrupt_latest_step_falls_back_to_the_newest_intact_one_and_is_moved_aside(tmp_path, caplog, damage,
                                                                                   stray_reports):
    import numpy as np

    from dgemma.checkpoint import CheckpointManager

    state, target = _state()
    d = tmp_path / "ckpt"
    _save_steps(d, [1, 2, 3], state)
    assert damage(d / "3") > 0
    with caplog.at_level("WARNING", logger="dgemma.checkpoint.manager"), CheckpointManager(d) as ckpt:
        restored = ckpt.restore(target)
        assert restored.step == 2 and int(restored.state.step) == 2 and restored.data_state == {"step": 2}
        assert np.array_equal(np.asarray(restored.state.params["embed"][...]), np.asarray(state.params["embed"][...]))
        assert ckpt.all_steps() == [1, 2]
        # the corrupt step is kept for inspection, out of the way of a new save of step 3
        assert (d / "3.corrupt").is_dir() and not (d / "3").exists()
        assert ckpt.save(3, state.replace(step=restored.state.step + 1), data_state={"step": 3})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "corrupt checkpoint step 3" in warnings[0] and "resuming from step 2" in warnings[0]
    assert "3.corrupt" in warnings[0] and len(warnings[0]) < 600
    assert stray_reports() == []
    # nor do orbax / asyncio log the failed reads (each record would carry a traceback)
    assert [r.getMessage()[:200] for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []


def test_no_intact_step_is_one_line_and_renames_nothing(tmp_path, stray_reports):
    from dgemma.checkpoint import CheckpointCorruptError, CheckpointManager

    state, target = _state()
    d = tmp_path / "ckpt"
    _save_steps(d, [1, 2], state)
    for s in (1, 2):
        _truncate_data_files(d / str(s))
    with CheckpointManager(d) as ckpt:
        with pytest.raises(CheckpointCorruptError) as info:
            ckpt.restore(target)
        message = str(info.value)
        assert "no intact checkpoint" in message and str(d) in message and "[2, 1]" in message
        assert "\n" not in message and len(message) < 900
        with pytest.raises(CheckpointCorruptError, match="checkpoint step 2 .* is unreadable"):
            ckpt.restore(target, step=2)  # an explicit step: no fallback
    assert sorted(p.name for p in d.iterdir()) == ["1", "2"]  # nothing renamed
    assert stray_reports() == []


# MARK: changed model --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changed, needle", [
    ({"experts": 4}, "'params/experts/value' is (8, 8, 4) float32 in the checkpoint but (4, 8, 4) float32"),
    ({"extra_layer": True}, "'params/extra/value' is in the model being restored but not in the checkpoint"),
])
def test_a_changed_model_is_one_mismatch_line_naming_the_path(tmp_path, changed, needle):
    from dgemma.checkpoint import CheckpointManager, CheckpointMismatchError

    state, _ = _state()
    d = tmp_path / "ckpt"
    _save_steps(d, [5], state)
    _, other = _state(**changed)
    with CheckpointManager(d) as ckpt:
        with pytest.raises(CheckpointMismatchError) as info:
            ckpt.restore(other)
    message = str(info.value)
    assert needle in message, message
    assert "checkpoint step 5" in message and str(d) in message and "run.name" in message and "init_from" in message
    assert "\n" not in message and isinstance(info.value, ValueError)
    assert sorted(p.name for p in d.iterdir()) == ["5"]  # a mismatch is not corruption: nothing moved


def test_a_checkpoint_of_another_structure_is_one_capped_line(tmp_path):
    """E.g. an SD-RL checkpoint ({"train", "reference", "ema"}) resumed as a plain TrainState."""
    from dgemma.checkpoint import CheckpointManager, CheckpointMismatchError

    state, target = _state()
    d = tmp_path / "ckpt"
    with CheckpointManager(d, async_save=False) as ckpt:
        ckpt.save(2, {"train": state, "reference": state.params, "ema": state.params})
    with CheckpointManager(d) as ckpt:
        with pytest.raises(CheckpointMismatchError) as info:
            ckpt.restore(target)
    message = str(info.value)
    assert "'params/embed/value' is in the model being restored but not in the checkpoint" in message
    assert "not in the model" in message and "\n" not in message and len(message) <= 900


# MARK: params-only checkpoints ----------------------------------------------------------------------------------------
def test_restore_params_mismatch_missing_and_corrupt_paths_are_one_line(tmp_path, stray_reports):
    from dgemma.checkpoint import CheckpointCorruptError, CheckpointMismatchError, restore_params, save_params

    state, target = _state()
    _, other = _state(experts=2)
    root = tmp_path / "params"
    step_dir = save_params(root, 4, state.params)
    with pytest.raises(CheckpointMismatchError,
                       match=r"params checkpoint step 4 in .*'experts' is \(8, 8, 4\) float32 in the checkpoint but"):
        restore_params(root, other.params)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        restore_params(tmp_path / "nope", target.params)
    ckpt = tmp_path / "ckpt"  # a training checkpoint given where params are expected
    _save_steps(ckpt, [1], state)
    with pytest.raises(CheckpointMismatchError, match="holds no 'params' item"):
        restore_params(ckpt, target.params)
    _truncate_data_files(step_dir)
    for path in (root, step_dir):
        with pytest.raises(CheckpointCorruptError) as info:
            restore_params(path, target.params)
        assert "params checkpoint step 4" in str(info.value) and "\n" not in str(info.value)
    assert sorted(p.name for p in root.iterdir()) == ["4"]  # a reader moves nothing
    assert stray_reports() == []


def test_restore_model_below_the_cli_builds_the_model_or_names_the_differing_parameter(tmp_path):
    import jax
    import numpy as np
    from flax import nnx

    from dgemma.checkpoint import CheckpointMismatchError, save_params
    from dgemma.checkpoint.model import restore_model
    from dgemma.config import load_config
    from dgemma.model.transformer import Transformer
    from dgemma.parallel.mesh import make_mesh

    cfg = load_config(TINY, ["model.num_hidden_layers=1", "model.layer_types=[full_attention]"], env={})
    params = nnx.state(Transformer(cfg.model_config, rngs=nnx.Rngs(3)), nnx.Param)
    save_params(tmp_path / "params", 2, params)
    mesh = make_mesh({"fsdp": 2}, jax.devices()[:2])
    model, restored = restore_model(cfg.model_config, tmp_path / "params", mesh=mesh, rules="fsdp", sampling=True)
    want, got = jax.tree.leaves(params), jax.tree.leaves(nnx.state(model, nnx.Param))
    assert len(want) == len(got) and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(want, got))
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(restored))
    more = cfg.with_overrides("model.num_hidden_layers=2", "model.layer_types=[full_attention, full_attention]")
    with pytest.raises(CheckpointMismatchError, match=r"'layers/1/.*' is in the model being restored but not in the "
                                                      r"checkpoint") as info:
        restore_model(more.model_config, tmp_path / "params", mesh=mesh, rules="fsdp")
    assert "\n" not in str(info.value)


# MARK: disk full (subprocess with a file-size limit) ------------------------------------------------------------------
def _disk_full_script(out: Path) -> None:
    """Save under a file-size limit; print what happened as JSON (the parent asserts)."""
    import resource
    import signal

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dgemma.checkpoint import CheckpointManager, CheckpointWriteError, save_params

    sharding = NamedSharding(jax.make_mesh((1,), ("x",)), PartitionSpec())
    state = {"w": jax.device_put(jnp.arange(200_000, dtype=jnp.float32), sharding)}
    later = {"w": state["w"] + 1}
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)
    jax.block_until_ready(later)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    report = {}
    for mode in ("sync", "async_wait", "async_next_save"):
        d = out / mode
        ckpt = CheckpointManager(d, async_save=mode != "sync")
        ckpt.save(1, state)
        ckpt.wait_until_finished()
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        errors = []
        try:
            try:
                ckpt.save(2, later)
                if mode == "async_wait":
                    ckpt.wait_until_finished()
                elif mode == "async_next_save":
                    ckpt.save(3, later)
            except CheckpointWriteError as e:
                errors.append([type(e).__name__, str(e), e.errno])
            try:
                ckpt.close()  # the error surfaced once: closing does not raise it again
            except Exception as e:  # noqa: BLE001 - reported to the parent
                errors.append([type(e).__name__, str(e)[:300], None])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        with CheckpointManager(d) as again:
            restored = again.restore(target)
            report[mode] = {"errors": errors, "entries": sorted(p.name for p in d.iterdir()),
                            "restored_step": restored.step, "w1": float(restored.state["w"][1])}
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        save_params(out / "run" / "params", 7, later)
        params_error = None
    except CheckpointWriteError as e:
        params_error = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    report["params"] = {"error": params_error, "run_dir": sorted(p.name for p in (out / "run").iterdir())}
    print("REPORT " + json.dumps(report))


def test_disk_full_is_one_error_the_tmp_dir_is_removed_and_the_last_step_restores(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DGEMMA_", "JAX_COMPILATION_CACHE"))}
    (tmp_path / "run").mkdir()
    proc = subprocess.run([sys.executable, __file__, "disk-full", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT ", 1)[1])
    for mode in ("sync", "async_wait", "async_next_save"):
        r = report[mode]
        assert len(r["errors"]) == 1, (mode, r["errors"])  # once, and closing is quiet
        name, message, code = r["errors"][0]
        assert name == "CheckpointWriteError" and code == 27, r  # EFBIG
        assert message == f"no space left writing step 2 to {tmp_path / mode}; the last good checkpoint is step 1"
        assert r["entries"] == ["1"], (mode, r["entries"])  # no *.orbax-checkpoint-tmp* left
        assert r["restored_step"] == 1 and r["w1"] == 1.0
    assert report["params"]["error"] == (f"no space left writing params step 7 to {tmp_path / 'run' / 'params'}; "
                                         f"the last good checkpoint is none (no committed checkpoint there)")
    assert report["params"]["run_dir"] == []  # the params directory this call created is gone again
    # orbax's own per-thread error logs (each with a traceback) are filtered: nothing about the failure on stderr
    assert "Traceback" not in proc.stderr and "File too large" not in proc.stderr, proc.stderr[-3000:]


def test_disk_full_covers_enospc_edquot_efbig_in_every_form_orbax_reports_them():
    """The real EFBIG path runs above; ENOSPC and EDQUOT arrive in the same two forms (a Python OSError, or the text of
    a tensorstore error raised as ValueError), which is what the classification reads."""
    import errno

    from dgemma.checkpoint.errors import disk_full_errno, is_corruption

    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        assert disk_full_errno(OSError(code, os.strerror(code))) == code
        tensorstore = ValueError(f'OUT_OF_RANGE: Error writing "w/c/0": Failed to write 1 bytes to file 7: '
                                 f"{os.strerror(code)} [os_error_code='{code}']")
        assert disk_full_errno(tensorstore) == code
        try:
            try:
                raise tensorstore
            except ValueError as e:
                raise RuntimeError("save failed") from e
        except RuntimeError as wrapped:
            assert disk_full_errno(wrapped) == code
    assert disk_full_errno(PermissionError(errno.EACCES, "Permission denied")) is None
    assert disk_full_errno(ValueError("NOT_FOUND: x [os_error_code='2']")) is None
    # corrupt = damaged / missing bytes; an environmental failure must not get a good step moved aside
    assert is_corruption(ValueError("DATA_LOSS: Error decoding manifest")) and is_corruption(FileNotFoundError("x"))
    assert not is_corruption(ValueError("RESOURCE_EXHAUSTED: out of memory"))
    assert not is_corruption(PermissionError(errno.EACCES, "Permission denied"))


# MARK: end to end -----------------------------------------------------------------------------------------------------
TRAIN = ["train", "-c", TINY, "--no-progress", "trainer.objective=ar", "model.preset=tiny", "model.vocab_size=32",
         "model.num_hidden_layers=1", "model.layer_types=[full_attention]", "mesh.ici={fsdp: -1}",
         "optim.schedule=constant", "optim.warmup_steps=0", "trainer.log_every=1", "trainer.eval_every=0",
         "checkpoint.every=1", "checkpoint.keep=5", "data.num_threads=0", "data.batch_size=8", "run.name=r"]


def test_dgemma_train_resumes_past_a_truncated_latest_checkpoint(tmp_path, caplog, capsys, stray_reports):
    from dgemma.cli.main import main

    out = f"run.output_dir={tmp_path}"
    assert main([*TRAIN, out, "trainer.steps=2"]) == 0
    ckpt = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["1", "2"]
    assert _truncate_data_files(ckpt / "2") > 0
    with caplog.at_level("WARNING", logger="dgemma.checkpoint.manager"):
        assert main([*TRAIN, out, "trainer.steps=3"]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "dgemma.checkpoint.manager"]
    assert len(warnings) == 1 and "corrupt checkpoint step 2" in warnings[0], warnings
    assert "resuming from step 1" in warnings[0]
    # resumed from step 1: steps 2 and 3 were trained again and saved; the corrupt step is kept aside
    assert sorted(p.name for p in ckpt.iterdir()) == ["1", "2", "2.corrupt", "3"]
    assert "done: steps 1->3" in capsys.readouterr().out
    assert stray_reports() == []

    # A full disk during the next run: every file over 64 kB fails with EFBIG (the larger OCDBT data files of the
    # checkpoint; the programs come from the session's compilation cache, which this process only reads).
    limited = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
               "os.execv(sys.executable, [sys.executable, '-m', 'dgemma', *sys.argv[1:]])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGEMMA_")}
    env.update(JAX_NUM_CPU_DEVICES="8", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1e9")
    proc = subprocess.run([sys.executable, "-c", limited, *TRAIN, out, "trainer.steps=4"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert err[-1] == (f"dgemma train: CheckpointWriteError: no space left writing step 4 to {ckpt}; the last good "
                       f"checkpoint is step 3  (set DGEMMA_DEBUG=1 for the traceback)"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "File too large" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["1", "2", "2.corrupt", "3"]  # no temporary directory left


if __name__ == "__main__":
    if sys.argv[1] == "disk-full":
        _disk_full_script(Path(sys.argv[2]))
