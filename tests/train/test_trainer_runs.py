"""The trainer's runs end to end: exact resume after a kill, SIGTERM, non-finite loss, the data state (the refusals
before anything is written are tests/train/test_trainer_refusals.py).

In-process tests use a small MLP and a synthetic random-access data source (compiles in about a second):
non-finite loss, atomic run-dir creation, interrupted + resumed == straight, data-state checks.

Subprocess tests run the tiny Gemma 4 MoE transformer on the grain data pipeline (toy tokenizer, synthetic tasks) on
4 simulated CPU devices (mesh data=2 x fsdp=2) through this file's script mode
(`python tests/train/test_trainer_runs.py OUT [--hang-at N | --pause-at N --marker F --ack F]`):
  * exact resume: 6 steps straight vs. a run SIGKILLed after it committed checkpoint 3 (it hangs in the data loader
    before step 6), resumed to 6: final params and optimizer state bit-identical, identical metrics.jsonl per step;
  * SIGTERM: checkpoint at the current step boundary, exit code 0.
All subprocesses share a persistent XLA compilation cache, so only the first one pays for compilation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from support import fast_xla

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


# MARK: shared config -------------------------------------------------------------------------------------------------
def _config(output_dir, name="run", **overrides):
    from dgemma.config import load_config

    base = {
        "run.name": name, "run.output_dir": str(output_dir), "run.seed": 0,
        "model.preset": "tiny", "model.vocab_size": 32, "model.num_hidden_layers": 2,
        "model.layer_types": ["sliding_attention", "full_attention"],
        "mesh.ici": {"data": 2, "fsdp": 2}, "mesh.rules": "fsdp",
        "trainer.steps": STEPS, "trainer.log_every": 1,
        "optim.lr": 3e-3, "optim.warmup_steps": 2, "optim.weight_decay": 0.01,
        "data.layout": {"prompt_len": 16, "canvas_length": 8, "n_blocks": 2}, "data.batch_size": 8,
        "data.num_threads": 0, "data.seed": 7,
        "checkpoint.every": 3, "checkpoint.keep": 5,
        "logging.jsonl": True, "logging.wandb": False,
    }
    base.update(overrides)
    return load_config(None, base, env={})


def _pipeline(cfg):
    from dgemma.data.pipeline import DataPipeline

    return DataPipeline(cfg.data, process_index=0, process_count=1)


class HookedData:
    """Wraps a data source; `hook(index)` runs before the batch with that index is read (in the main thread)."""

    def __init__(self, data, hook):
        self._data, self._hook = data, hook
        self.tokenizer = getattr(data, "tokenizer", None)

    def iterator_from_step(self, step):
        return HookedIterator(self._data.iterator_from_step(step), self._hook)


class HookedIterator:
    def __init__(self, it, hook):
        self._it, self._hook = it, hook

    def __iter__(self):
        return self

    def __next__(self):
        self._hook(self.step)
        return next(self._it)

    @property
    def step(self):
        return self._it.step

    def get_state(self):
        return self._it.get_state()

    def set_state(self, state):
        self._it.set_state(state)

    def close(self):
        if hasattr(self._it, "close"):
            self._it.close()


def _flat_state(state):
    import jax

    from dgemma.train.optim import param_path

    return {param_path(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


# MARK: script mode (subprocesses) ------------------------------------------------------------------------------------
def noisy_ar_loss(model, batch, rng):
    """AR loss on a random 80% of the supervised tokens: the step's rng matters, as it will for the diffusion loss."""
    import jax

    from dgemma.diffusion.ar import ar_loss_fn

    keep = jax.random.bernoulli(rng, 0.8, batch["ar_weight"].shape)
    return ar_loss_fn(model, {**batch, "ar_weight": batch["ar_weight"] * keep}, rng)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--name", default="run")
    p.add_argument("--hang-at", type=int, default=None, help="block forever before reading batch N")
    p.add_argument("--pause-at", type=int, default=None, help="before batch N: write --marker, wait for --ack")
    p.add_argument("--marker", default=None)
    p.add_argument("--ack", default=None)
    args = p.parse_args(argv)

    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    from dgemma.train.trainer import train

    def hook(index):
        if index == args.hang_at:
            Path(args.marker).touch()
            while True:
                time.sleep(1)
        if index == args.pause_at:
            Path(args.marker).touch()
            deadline = time.time() + 120
            while not Path(args.ack).exists() and time.time() < deadline:
                time.sleep(0.02)

    cfg = _config(args.out, args.name)
    summary = train(cfg, data=HookedData(_pipeline(cfg), hook), loss_fn=noisy_ar_loss, progress=False)
    np.savez(Path(args.out) / f"{args.name}_final_state.npz", **_flat_state(summary.state))
    result = {k: v for k, v in dataclasses.asdict(summary).items() if k != "state"}
    print("SUMMARY " + json.dumps(result), flush=True)
    return 0


def _env(cache_dir):
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]),  # tests/: support
        JAX_PLATFORMS="cpu",
        WANDB_MODE="disabled",
        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    env["XLA_FLAGS"] = fast_xla.xla_flags()
    return env


def _cmd(out, *extra):
    return [sys.executable, str(Path(__file__).resolve()), str(out), *map(str, extra)]


def _summary(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, stdout
    return json.loads(lines[-1][len("SUMMARY "):])


def _wait_for(predicate, proc, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"process exited ({proc.returncode}) before {what}:\n{out}\n{err[-4000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla_cache")


def _loss_curve(path):
    from dgemma.tracking import read_jsonl

    keep = ("loss", "grad_norm", "lr", "ar_accuracy", "ar_tokens")
    return [(r["step"], *(r[k] for k in keep)) for r in read_jsonl(path)]


@pytest.mark.slow  # three training subprocesses; the default run keeps the in-process resume test below
def test_exact_resume_after_sigkill_matches_straight_run(tmp_path, xla_cache):
    env = _env(xla_cache)
    straight = subprocess.run(_cmd(tmp_path / "a"), env=env, capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-4000:]
    s = _summary(straight.stdout)
    assert s["start_step"] == 0 and s["final_step"] == STEPS and s["checkpoint_steps"] == [3, 6]

    run_dir = tmp_path / "b" / "run"
    marker = tmp_path / "hang.marker"
    proc = subprocess.Popen(_cmd(tmp_path / "b", "--hang-at", 5, "--marker", marker), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: marker.exists() and (run_dir / "checkpoints" / "3").is_dir(), proc, 600,
                  "checkpoint 3 and the hang before step 6")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [3]
    killed_curve = _loss_curve(run_dir / "metrics.jsonl")
    assert [r[0] for r in killed_curve] == [1, 2, 3, 4]  # it had logged past its last checkpoint

    resumed = subprocess.run(_cmd(tmp_path / "b"), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    r = _summary(resumed.stdout)
    assert r["resumed"] and r["start_step"] == 3 and r["final_step"] == STEPS and r["steps_run"] == 3

    a = np.load(tmp_path / "a" / "run_final_state.npz")
    b = np.load(tmp_path / "b" / "run_final_state.npz")
    assert sorted(a.files) == sorted(b.files) and any(k.startswith("params/") for k in a.files)
    for k in a.files:
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs after resume"
    straight_curve = _loss_curve(tmp_path / "a" / "run" / "metrics.jsonl")
    assert [c[0] for c in straight_curve] == list(range(1, STEPS + 1))
    assert _loss_curve(run_dir / "metrics.jsonl") == straight_curve
    assert killed_curve == straight_curve[:4]
    assert straight_curve[-1][1] < straight_curve[0][1]  # and it learned something
    assert (run_dir / "resolved_config.yaml").exists() and (run_dir / "params" / str(STEPS)).is_dir()


@pytest.mark.slow  # a training subprocess (~minutes of compiling); the default run keeps the in-process test below
def test_sigterm_saves_at_the_current_step_and_exits_cleanly(tmp_path, xla_cache):
    marker, ack = tmp_path / "pause.marker", tmp_path / "ack"
    proc = subprocess.Popen(_cmd(tmp_path, "--pause-at", 3, "--marker", marker, "--ack", ack), env=_env(xla_cache),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(marker.exists, proc, 600, "the pause before batch 3")
        proc.send_signal(signal.SIGTERM)  # arrives while the loop waits for batch 3 (i.e. during step 4)
        ack.touch()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-4000:]
    s = _summary(out)
    assert s["preempted"] and s["final_step"] == 4 and s["checkpoint_steps"] == [3, 4]
    assert not (tmp_path / "run" / "params").exists()  # no end-of-training artefacts for a preempted run
    state = json.loads((tmp_path / "run" / "checkpoints" / "4" / "data" / "iterator.json").read_text())
    assert state["step"] == 4


# MARK: in-process tests with a small model ---------------------------------------------------------------------------
class ToyData:
    """Random-access regression batches (a pure function of the step); `nan_at` poisons that batch."""

    def __init__(self, nan_at=None, batch=8, fingerprint="toy-v1"):
        self.nan_at, self.batch_size, self.fingerprint = nan_at, batch, fingerprint

    def batch(self, step):
        rng = np.random.default_rng(1000 + step)
        x = rng.normal(size=(self.batch_size, 8)).astype(np.float32)
        if step == self.nan_at:
            x[0, 0] = np.nan
        return {"x": x, "y": np.sin(x @ np.arange(64, dtype=np.float32).reshape(8, 8) / 30)}

    def iterator_from_step(self, step):
        return ToyIterator(self, step)


class ToyIterator:
    def __init__(self, data, step):
        self.data, self.step = data, step

    def __next__(self):
        out = self.data.batch(self.step)
        self.step += 1
        return out

    def get_state(self):
        return {"step": self.step, "fingerprint": self.data.fingerprint}

    def set_state(self, state):
        if state["fingerprint"] != self.data.fingerprint:
            raise ValueError(f"fingerprint {state['fingerprint']} != {self.data.fingerprint}")
        self.step = state["step"]


def _mlp_factory(rngs):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dgemma.model.layers import param

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = param(rngs, (8, 32), ("embed", "mlp"), jnp.float32, std=0.3)
            self.b = param(rngs, (32, 8), ("mlp", "embed"), jnp.float32, std=0.3)

        def __call__(self, x):
            return jax.nn.tanh(x @ self.a[...]) @ self.b[...]

    return MLP(rngs)


def _mse(model, batch, rng):
    import jax.numpy as jnp

    import jax

    err = model(batch["x"]) - batch["y"] + 0.1 * jax.random.normal(rng, batch["y"].shape)  # the step's rng matters
    return jnp.mean(err**2), {"max_err": jnp.max(jnp.abs(err))}


def _toy_cfg(tmp_path, **kw):
    return _config(tmp_path, **{"mesh.ici": {"data": 2, "fsdp": 4}, "optim.lr": 1e-2, **kw})


def _toy_train(cfg, data=None, **kw):
    from dgemma.train.trainer import train

    return train(cfg, data=data or ToyData(), loss_fn=_mse, model_factory=_mlp_factory, progress=False, **kw)


def test_nonfinite_loss_raises_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    from dgemma.checkpoint import CheckpointManager
    from dgemma.tracking import read_jsonl
    from dgemma.train.nonfinite import NonFiniteLossError

    cfg = _toy_cfg(tmp_path, **{"trainer.steps": 8, "checkpoint.every": 1, "checkpoint.keep": 2})
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss at step 5 .*the last good checkpoint is step 4"):
        _toy_train(cfg, data=ToyData(nan_at=4))  # batch index 4 is consumed by step 5
    with CheckpointManager(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [3, 4]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["step"] == 5 and rows[-1]["loss"] == "nan"  # the bad step is logged for diagnosis


def test_interrupted_then_resumed_equals_straight_in_process(tmp_path):
    straight = _toy_train(_toy_cfg(tmp_path / "a"))
    assert straight.final_step == STEPS and straight.checkpoint_steps == [3, 6]

    class Stop(Exception):
        pass

    def stop_at_5(step, metrics):
        if step == 5:
            raise Stop

    cfg = _toy_cfg(tmp_path / "b")
    with pytest.raises(Stop):
        _toy_train(cfg, on_step=stop_at_5)
    resumed = _toy_train(cfg)
    assert resumed.resumed and resumed.start_step == 3 and resumed.steps_run == 3
    a, b = _flat_state(straight.state), _flat_state(resumed.state)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    from dgemma.tracking import read_jsonl

    def curve(d):
        return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in read_jsonl(d / "run" / "metrics.jsonl")]

    assert curve(tmp_path / "b") == curve(tmp_path / "a") and len(curve(tmp_path / "a")) == STEPS
    done = _toy_train(cfg)  # nothing left to do
    assert done.steps_run == 0 and done.final_step == STEPS


def test_resume_checks_the_saved_data_state(tmp_path):
    cfg = _toy_cfg(tmp_path, **{"trainer.steps": 4, "checkpoint.every": 2})
    with pytest.raises(KeyboardInterrupt):
        _toy_train(cfg, on_step=_interrupt_at(3))
    with pytest.raises(ValueError, match="cannot resume the data stream at step 2: fingerprint"):
        _toy_train(cfg, data=ToyData(fingerprint="other-data"))
    resolved = (tmp_path / "run" / "resolved_config.yaml").read_text()
    with pytest.raises(ValueError, match="resume=false"):
        _toy_train(cfg.with_overrides("checkpoint.resume=false"))
    # a failed resume leaves the run's resolved config alone (it still describes the checkpoints)
    assert (tmp_path / "run" / "resolved_config.yaml").read_text() == resolved
    assert not list((tmp_path / "run").glob("resolved_config.*.yaml"))


def test_sigterm_in_process_saves_at_the_current_step_and_returns(tmp_path):
    """The default-run version of the SIGTERM subprocess test: the same PreemptionGuard and save-at-the-boundary path,
    with the signal delivered to this process while the loop waits for batch 3 (i.e. during step 4)."""
    import os
    import signal

    from dgemma.checkpoint import CheckpointManager

    def hook(index):
        if index == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    cfg = _toy_cfg(tmp_path, **{"trainer.steps": STEPS, "checkpoint.every": 3})
    s = _toy_train(cfg, data=HookedData(ToyData(), hook))
    assert signal.getsignal(signal.SIGTERM) is before  # the guard restored the previous handler
    assert s.preempted and s.final_step == 4 and s.checkpoint_steps == [3, 4]
    assert not (tmp_path / "run" / "params").exists()  # no end-of-training artefacts for a preempted run
    with CheckpointManager(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [3, 4]
    state = json.loads((tmp_path / "run" / "checkpoints" / "4" / "data" / "iterator.json").read_text())
    assert state["step"] == 4
    resumed = _toy_train(cfg)  # and the preempted run resumes from the step it saved
    assert resumed.resumed and resumed.start_step == 4 and resumed.final_step == STEPS


def _interrupt_at(n):
    def f(step, metrics):
        if step == n:
            raise KeyboardInterrupt

    return f


def test_startup_failure_leaves_no_run_dir(tmp_path, monkeypatch):
    from dgemma import config as config_lib
    from dgemma.train.trainer import train

    cfg = _toy_cfg(tmp_path)

    def broken_factory(rngs):
        raise RuntimeError("model construction failed")

    with pytest.raises(RuntimeError, match="model construction failed"):
        train(cfg, data=ToyData(), loss_fn=_mse, model_factory=broken_factory, progress=False)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="global batch size 6 .* not divisible by .* data x fsdp = 8"):
        _toy_train(cfg, data=ToyData(batch=6))  # caught by the ahead-of-time compile, before the run dir
    assert list(tmp_path.iterdir()) == []

    real = config_lib.dump_resolved

    def half_written(c, run_dir):
        (Path(run_dir) / "resolved_config.yaml").write_text("partial")
        raise OSError("disk full")

    monkeypatch.setattr(config_lib, "dump_resolved", half_written)
    with pytest.raises(OSError, match="disk full"):
        _toy_train(cfg)
    assert list(tmp_path.iterdir()) == []  # neither the run dir nor its temporary sibling

    monkeypatch.setattr(config_lib, "dump_resolved", real)
    summary = _toy_train(cfg.with_overrides("trainer.steps=2", "checkpoint.every=0"))
    run_dir = tmp_path / "run"
    assert {p.name for p in run_dir.iterdir()} >= {"resolved_config.yaml", "config.sha256", "metrics.jsonl",
                                                   "checkpoints", "params"}
    assert (run_dir / "config.sha256").read_text().strip() == summary.config_sha
    assert summary.checkpoint_steps == [2]  # every=0: only at the end
    from dgemma.checkpoint import CheckpointManager

    with CheckpointManager(run_dir / "checkpoints") as ckpt:
        md = ckpt.metadata(2)
    assert md["config_sha"] == summary.config_sha and md["step"] == 2 and md["dgemma_version"]


if __name__ == "__main__":
    sys.exit(main())


def test_resume_at_the_final_step_rewrites_lost_params(tmp_path):
    """The run died after its last checkpoint but before params/ was written: a rerun writes params/ and reports
    that no step ran."""
    import shutil

    from dgemma.checkpoint import restore_params

    cfg = _toy_cfg(tmp_path, **{"trainer.steps": 4, "checkpoint.every": 2})
    first = _toy_train(cfg)
    params = tmp_path / "run" / "params"
    shutil.rmtree(params / "4")
    (params / "4.orbax-checkpoint-tmp-123").mkdir()  # what a kill mid-write leaves
    again = _toy_train(cfg)
    assert again.steps_run == 0 and again.start_step == again.final_step == 4 and "loss" not in again.last_metrics
    import jax

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), first.state.params)
    restored = restore_params(params, target)
    a, b = _flat_state(first.state.params), _flat_state(restored)
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_resume_with_fewer_steps_than_the_checkpoint_is_refused(tmp_path):
    from dgemma.config import ConfigError

    cfg = _toy_cfg(tmp_path, **{"trainer.steps": 4, "checkpoint.every": 2})
    _toy_train(cfg)
    resolved = (tmp_path / "run" / "resolved_config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"trainer.steps=2 is below the step 4 of the checkpoint"):
        _toy_train(cfg.with_overrides("trainer.steps=2"))
    assert (tmp_path / "run" / "resolved_config.yaml").read_text() == resolved


def test_second_trainer_on_the_same_run_dir_fails_at_once(tmp_path):
    """While one process trains in a run dir, another fails before compiling (the run directory's lock)."""
    from dgemma.train.trainer import train
    from dgemma.train.run_lock import RunDirInUse, run_dir_lock

    cfg = _toy_cfg(tmp_path, **{"trainer.steps": 2})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
        "print('locked', flush=True); time.sleep(120)"), str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        def never_built(rngs):  # the refusal comes before the model is even built (let alone compiled)
            raise AssertionError("model built despite the lock")

        with pytest.raises(RunDirInUse, match="in use by another training process"):
            train(cfg, data=ToyData(), loss_fn=_mse, model_factory=never_built, progress=False)
        assert list(run_dir.iterdir()) == []
    finally:
        holder.kill()
        holder.wait()
    _toy_train(cfg)  # the lock died with its holder
    with run_dir_lock(run_dir), pytest.raises(RunDirInUse):
        with run_dir_lock(run_dir):
            pass
