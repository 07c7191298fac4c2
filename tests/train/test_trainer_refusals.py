"""The one trainer (`dgemma.train.trainer`): what it refuses before writing anything, and its resume checks.

A small MLP on synthetic regression batches (test_trainer_runs.py's toy, compiles in about a second) for the runs;
the SD·RL refusals come before any model is built, so they need no rollout. An SD·RL checkpoint directory is made
with the real `CheckpointManager` and the metadata the trainer records (its state is a stand-in: the trainer refuses
before restoring it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_trainer_runs import ToyData, _flat_state, _mse, _toy_cfg, _toy_train

REPO = Path(__file__).resolve().parents[2]
STAGE2 = REPO / "configs/stage2/tiny.yaml"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _hold_lock(path: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('locked', flush=True); time.sleep(120)"), str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def _cli(capsys, *argv) -> tuple[int, str]:
    from dgemma.cli.main import main

    code = main(["train", "--no-progress", *map(str, argv)])
    return code, capsys.readouterr().err.strip()


# MARK: a shared checkpoint.dir ---------------------------------------------------------------------------------------
def test_a_second_run_on_a_checkpoint_dir_in_use_fails_at_once_and_writes_nothing(tmp_path):
    """Two runs with different run names and one checkpoint.dir: while the first holds it, the second fails before
    building its model, naming the directory, and creates no run dir."""
    from dgemma.train.trainer import train
    from dgemma.train.run_lock import RunDirInUse

    shared = tmp_path / "shared_ckpt"
    shared.mkdir()
    holder = _hold_lock(shared)  # what a running trainer holds on its checkpoint dir

    def never_built(rngs):
        raise AssertionError("model built despite the lock")

    try:
        cfg = _toy_cfg(tmp_path / "out", name="second", **{"checkpoint.dir": str(shared)})
        with pytest.raises(RunDirInUse, match=rf"^checkpoint.dir {shared} is in use by another training process"):
            train(cfg, data=ToyData(), loss_fn=_mse, model_factory=never_built, progress=False)
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "out").exists() and list(shared.iterdir()) == []


_STARTING_UP = """
import sys, time
from pathlib import Path

from test_trainer_runs import ToyData, _mlp_factory, _mse, _toy_cfg
from dgemma.train.trainer import train

def slow_start(rngs):  # stands for the slow start-up (a real model's init and compile): the run holds its locks
    print("starting up", flush=True)
    time.sleep(600)
    return _mlp_factory(rngs)

cfg = _toy_cfg(Path(sys.argv[1]), name="first", **{"checkpoint.dir": sys.argv[2]})
train(cfg, data=ToyData(), loss_fn=_mse, model_factory=slow_start, progress=False)
"""


def test_a_run_still_starting_up_already_holds_its_checkpoint_dir(tmp_path):
    """Two real processes on one checkpoint.dir: while the first is still in its start-up (building its model, long
    before its compile), the second is refused within seconds, in one line naming the directory, and writes nothing:
    no run dir (no resolved_config.yaml / config.sha256), nothing in the checkpoint dir."""
    import time

    from dgemma.train.trainer import train
    from dgemma.train.run_lock import RunDirInUse

    shared = tmp_path / "shared_ckpt"
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    first = subprocess.Popen([sys.executable, "-c", _STARTING_UP, str(tmp_path / "out"), str(shared)],
                             cwd=Path(__file__).parent, stdout=subprocess.PIPE, text=True, env=env)

    def never_built(rngs):
        raise AssertionError("model built despite the lock")

    try:
        line = first.stdout.readline()
        while line and line.strip() != "starting up":
            line = first.stdout.readline()
        assert line.strip() == "starting up", f"the first run ended with exit code {first.wait()}"
        cfg = _toy_cfg(tmp_path / "out", name="second", **{"checkpoint.dir": str(shared)})
        t0 = time.monotonic()
        with pytest.raises(RunDirInUse) as refused:
            train(cfg, data=ToyData(), loss_fn=_mse, model_factory=never_built, progress=False)
        assert time.monotonic() - t0 < 10
        assert str(refused.value).startswith(f"checkpoint.dir {shared} is in use by another training process")
        assert "\n" not in str(refused.value)
        assert not (tmp_path / "out" / "second").exists() and list(shared.iterdir()) == []
    finally:
        first.kill()
        first.wait()


def test_dgemma_train_on_a_checkpoint_dir_in_use_exits_1_with_one_line_and_writes_nothing(tmp_path, capsys):
    """The CLI refuses before its planner's memory-fit check (on an accelerator that plan may take long)."""
    shared = tmp_path / "shared_ckpt"
    shared.mkdir()
    holder = _hold_lock(shared)
    try:
        code, err = _cli(capsys, "-c", REPO / "configs/stage1/tiny.yaml", f"run.output_dir={tmp_path / 'out'}",
                         "run.name=second", f"checkpoint.dir={shared}")
    finally:
        holder.kill()
        holder.wait()
    assert code == 1 and err == (f"dgemma train: checkpoint.dir {shared} is in use by another training process; "
                                 "wait for it to finish or choose another run.name / checkpoint.dir"), err
    assert not (tmp_path / "out").exists() and list(shared.iterdir()) == []


def test_a_start_that_fails_leaves_no_checkpoint_dir_behind(tmp_path):
    """The checkpoint.dir a run creates to lock it at its start is removed again when the start fails."""
    from dgemma.train.trainer import train

    shared = tmp_path / "ckpts" / "shared"

    def broken(rngs):
        raise RuntimeError("broken model")

    cfg = _toy_cfg(tmp_path / "out", name="first", **{"checkpoint.dir": str(shared)})
    with pytest.raises(RuntimeError, match="broken model"):
        train(cfg, data=ToyData(), loss_fn=_mse, model_factory=broken, progress=False)
    assert not (tmp_path / "ckpts").exists() and not (tmp_path / "out").exists()


def test_the_trainer_holds_its_checkpoint_dir_while_it_runs(tmp_path):
    from dgemma.train.run_lock import RunDirInUse, check_free

    shared = tmp_path / "shared_ckpt"
    seen = []

    def probe(step, metrics):
        with pytest.raises(RunDirInUse):
            check_free(shared, "checkpoint.dir")
        seen.append(step)

    _toy_train(_toy_cfg(tmp_path / "a", **{"trainer.steps": 2, "checkpoint.dir": str(shared)}), on_step=probe)
    assert seen == [1, 2]
    check_free(shared)  # released at the end


def test_a_checkpoint_dir_written_by_another_run_name_is_refused_before_anything_is_written(tmp_path, capsys):
    from dgemma.config import ConfigError

    shared = tmp_path / "shared_ckpt"
    first = _toy_cfg(tmp_path / "out", name="first", **{"trainer.steps": 2, "checkpoint.dir": str(shared)})
    _toy_train(first)
    before = _files(shared)
    other = _toy_cfg(tmp_path / "out", name="other", **{"trainer.steps": 4, "checkpoint.dir": str(shared)})
    with pytest.raises(ConfigError, match=rf"checkpoint.dir {shared} holds checkpoints of run.name=first \(step 2\), "
                                          r"not of run.name=other; set run.name=first to continue that run"):
        _toy_train(other)
    assert not (tmp_path / "out" / "other").exists() and _files(shared) == before
    resumed = _toy_train(first.with_overrides("trainer.steps=4"))  # its own run continues
    assert resumed.resumed and resumed.start_step == 2 and resumed.final_step == 4


# MARK: resume checks -------------------------------------------------------------------------------------------------
def test_a_failed_restore_leaves_the_recorded_config_alone(tmp_path):
    """A resume whose restore fails (here: another model shape) does not rewrite the run's resolved config."""
    import jax.numpy as jnp
    from flax import nnx

    from dgemma.model.layers import param

    cfg = _toy_cfg(tmp_path, **{"trainer.steps": 2})
    _toy_train(cfg)
    run = tmp_path / "run"
    recorded = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and "config" in p.name}

    def wider(rngs):
        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.a = param(rngs, (8, 64), ("embed", "mlp"), jnp.float32, std=0.3)
                self.b = param(rngs, (64, 8), ("mlp", "embed"), jnp.float32, std=0.3)

            def __call__(self, x):
                return jnp.tanh(x @ self.a[...]) @ self.b[...]

        return MLP(rngs)

    from dgemma.train.trainer import train

    changed = cfg.with_overrides("trainer.steps=4", "optim.lr=2e-2")
    with pytest.raises(Exception, match=r"(?i)shape"):  # orbax / dgemma.checkpoint report the mismatch
        train(changed, data=ToyData(), loss_fn=_mse, model_factory=wider, progress=False)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and "config" in p.name} == recorded


def test_a_checkpoint_whose_state_is_at_another_step_is_refused(tmp_path):
    """The restored TrainState's step must equal the checkpoint's step (x the objective's updates per step)."""
    import jax

    from dgemma.checkpoint import CheckpointManager

    cfg = _toy_cfg(tmp_path, **{"trainer.steps": 2, "checkpoint.every": 2})
    done = _toy_train(cfg)
    ckpt = tmp_path / "run" / "checkpoints"
    with CheckpointManager(ckpt, async_save=False) as m:
        md = m.metadata(2)
        data = json.loads((ckpt / "2" / "data" / "iterator.json").read_text())
    state = done.state.replace(step=jax.numpy.asarray(5, jax.numpy.int32))
    with CheckpointManager(ckpt, async_save=False, metadata={k: v for k, v in md.items() if k != "step"}) as m:
        m.save(3, state, data_state={**data, "step": 3})
    with pytest.raises(ValueError, match=r"checkpoint 3 in .* holds a state after 5 optimizer updates, expected 3"):
        _toy_train(cfg.with_overrides("trainer.steps=4"))


def test_resuming_under_another_objective_names_both(tmp_path):
    from dgemma.config import ConfigError

    cfg = _toy_cfg(tmp_path, **{"trainer.steps": 2, "trainer.objective": "stage1"})
    _toy_train(cfg)
    recorded = (tmp_path / "run" / "resolved_config.yaml").read_bytes()
    with pytest.raises(ConfigError, match=r"cannot resume .*checkpoints \(step 2\) under trainer.objective=ar: it was "
                                          r"written by trainer.objective=stage1"):
        _toy_train(cfg.with_overrides("trainer.objective=ar", "trainer.steps=4"))
    assert (tmp_path / "run" / "resolved_config.yaml").read_bytes() == recorded


def test_every_objective_records_itself_and_its_resume_settings(tmp_path):
    from dgemma.checkpoint import CheckpointManager

    _toy_train(_toy_cfg(tmp_path, **{"trainer.steps": 2, "trainer.objective": "ar"}))
    with CheckpointManager(tmp_path / "run" / "checkpoints") as m:
        md = m.metadata(2)
    assert md["objective"] == "ar" and md["run_name"] == "run" and md["settings"] == {}


# MARK: settings an objective cannot honour ---------------------------------------------------------------------------
def _stage2(tmp_path, *overrides):
    from dgemma.config import load_config

    return load_config(STAGE2, [f"run.output_dir={tmp_path}", "run.name=s2", "trainer.steps=2", *overrides])


@pytest.mark.parametrize(("overrides", "pattern"), [
    (["sdrl.allow_random_init=true", "trainer.grad_accum_steps=2"],
     r"^dgemma train: invalid config: trainer.grad_accum_steps=2 does not apply to trainer.objective=sdrl"),
    ([], r"^dgemma train: invalid config: checkpoint.init_from is not set: stage 2 \(trainer.objective=sdrl\) starts from a stage-1 "
         r"params checkpoint .*sdrl.allow_random_init=true"),
])
def test_sdrl_refuses_in_one_line_before_anything_is_written(tmp_path, capsys, overrides, pattern):
    import re

    code, err = _cli(capsys, "-c", STAGE2, f"run.output_dir={tmp_path}", "run.name=s2", *overrides)
    assert code == 2 and len(err.splitlines()) == 1 and re.search(pattern, err), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("objective", ["stage1", "ar"])
def test_sdrl_settings_under_another_objective_are_refused(tmp_path, capsys, objective):
    import re

    cfg = REPO / "configs/stage1/tiny.yaml"
    code, err = _cli(capsys, "-c", cfg, f"run.output_dir={tmp_path}", f"trainer.objective={objective}",
                     "sdrl.group_size=4")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert re.search(rf"sdrl.group_size=4 is read only by trainer.objective=sdrl, but trainer.objective={objective}",
                     err), err
    assert list(tmp_path.iterdir()) == []


def test_sdrl_resume_with_a_changed_group_size_is_refused(tmp_path):
    """An SD·RL checkpoint directory written with sdrl.group_size=2: a resume with 4 is refused, one line, nothing
    written (the check reads the checkpoint metadata before the model is built)."""
    import jax.numpy as jnp

    from dgemma.checkpoint import CheckpointManager
    from dgemma.config import ConfigError
    from dgemma.train.objectives import get_objective
    from dgemma.train.sdrl import run_sdrl

    written = _stage2(tmp_path, "sdrl.group_size=2", "sdrl.allow_random_init=true")
    settings = get_objective("sdrl").recorded_settings(written)
    assert settings["sdrl.group_size"] == 2
    ckpt = written.checkpoint.directory(written.run)
    with CheckpointManager(ckpt, async_save=False,
                           metadata={"run_name": "s2", "objective": "sdrl", "settings": settings}) as m:
        m.save(1, {"stand_in": jnp.zeros(2)})
    before = _files(tmp_path)
    with pytest.raises(ConfigError, match=r"cannot resume .* \(step 1\) with sdrl.group_size=4: its checkpoints were "
                                          r"written with sdrl.group_size=2"):
        run_sdrl(_stage2(tmp_path, "sdrl.group_size=4", "sdrl.allow_random_init=true"), progress=False)
    assert _files(tmp_path) == before


def test_the_registry_owns_the_objective_names():
    import typing

    from dgemma.config.sections import TrainerSection
    from dgemma.train.objectives import OBJECTIVES, REGISTRY, get_objective

    literal = typing.get_type_hints(TrainerSection)["objective"]
    assert set(typing.get_args(literal)) == set(OBJECTIVES) == set(REGISTRY)
    assert get_objective("sdrl").updates_per_step(_config_stub(inner_epochs=3, num_minibatches=2)) == 6
    assert get_objective("ar").tokens_per_example(16, 8) == 24 and get_objective("stage1").tokens_per_example(16, 8) == 32
    with pytest.raises(ValueError, match=r"trainer.objective='nope' is not one of"):
        get_objective("nope")


def _config_stub(**sdrl):
    from types import SimpleNamespace

    return SimpleNamespace(sdrl=SimpleNamespace(**sdrl))


def test_toy_run_logs_the_shared_training_metrics(tmp_path):
    from dgemma.tracking import read_jsonl
    from dgemma.train.objectives import TRAIN_METRICS

    s = _toy_train(_toy_cfg(tmp_path, **{"trainer.steps": 2}))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(set(TRAIN_METRICS) <= set(r) for r in rows)
    assert s.last_metrics["tokens_per_sec"] > 0 and _flat_state(s.state)


def test_the_trainer_and_the_planner_branch_on_objective_attributes_not_names():
    """Objective names are compared only in the registry: the trainer and the planner read the `Objective`'s
    attributes (a new objective is one registry entry, not a hunt for `objective == "..."` branches)."""
    import re

    pattern = re.compile(r"""objective\s*[!=]=\s*["']|objective\s+(not\s+)?in\s*\(""")
    offenders = [f"{p.relative_to(REPO)}:{i}" for d in ("dgemma/train", "dgemma/planning")
                 for p in sorted((REPO / d).rglob("*.py")) if p.name != "objectives.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def test_a_checkpoint_dir_equal_to_the_run_dir_is_locked_once(tmp_path):
    cfg = _toy_cfg(tmp_path, **{"trainer.steps": 2, "checkpoint.dir": str(tmp_path / "run")})
    s = _toy_train(cfg)
    assert s.final_step == 2 and (tmp_path / "run" / "2").is_dir()
