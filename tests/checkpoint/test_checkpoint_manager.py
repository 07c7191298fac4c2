"""Checkpoint manager: round trip onto another mesh, atomic commit (interrupted saves are ignored), skip-existing,
retention, metadata, data state, params-only checkpoints."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dgemma.checkpoint import CheckpointManager, restore_params, save_params
from dgemma.config import load_config
from dgemma.model.layers import param
from dgemma.parallel.mesh import make_mesh
from dgemma.train.optim import build_optimizer
from dgemma.train.state import abstract_train_state, init_train_state, train_state_shardings, with_shardings


class Small(nnx.Module):
    def __init__(self, rngs):
        self.embed = param(rngs, (16, 8), ("vocab", "embed"), jnp.float32)
        self.experts = param(rngs, (8, 8, 4), ("exp", "embed", "exp_mlp"), jnp.float32)
        self.scale = param(rngs, (8,), ("embed",), jnp.float32, init="ones")


def _setup(mesh, seed=0, rules="fsdp"):
    optim = load_config(None, {"optim.lr": 1e-2}, env={}).optim
    opt = build_optimizer(optim, total_steps=10)
    factory = lambda rngs: Small(rngs)  # noqa: E731
    _, abstract = abstract_train_state(factory, opt.tx, seed)
    sh = train_state_shardings(abstract, opt.tx, mesh, rules)
    _, state = init_train_state(factory, opt.tx, seed, sh)
    # make the optimizer state non-trivial
    grads = jax.tree.map(jnp.ones_like, state.params)
    _, opt_state = opt.tx.update(grads, state.opt_state, state.params)
    return state.replace(opt_state=opt_state, step=jnp.asarray(7, jnp.int32)), abstract, sh, opt


def _equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_round_trip_onto_a_different_mesh_with_current_shardings(tmp_path):
    mesh8 = make_mesh({"data": 2, "fsdp": 4})
    state, abstract, _, opt = _setup(mesh8)
    data_state = {"version": 1, "step": 7, "fingerprint": "abc"}
    with CheckpointManager(tmp_path / "ckpt", metadata={"config_sha": "f00"}) as ckpt:
        assert ckpt.restore(with_shardings(abstract, train_state_shardings(abstract, opt.tx, mesh8, "fsdp"))) is None
        assert ckpt.save(7, state, data_state=data_state)

    mesh4 = make_mesh({"fsdp": 4}, jax.devices()[4:])  # 8 -> 4 devices, other device ids, other rules
    sh4 = train_state_shardings(abstract, opt.tx, mesh4, "experts_on_fsdp")
    with CheckpointManager(tmp_path / "ckpt") as ckpt:
        restored = ckpt.restore(with_shardings(abstract, sh4))
    assert restored.step == 7 and restored.data_state == data_state
    assert _equal(restored.state, state)
    experts = restored.state.params["experts"][...]
    assert experts.sharding.mesh == mesh4 and experts.sharding.spec == jax.sharding.PartitionSpec("fsdp", None, None)
    # scalar optimizer leaves come back replicated on the new mesh (not SingleDeviceSharding)
    count = [x for x in jax.tree.leaves(restored.state.opt_state) if x.ndim == 0][0]
    assert count.sharding.mesh == mesh4 and count.sharding.is_fully_replicated
    md = restored.metadata
    assert md["config_sha"] == "f00" and md["step"] == 7 and md["dgemma_version"]


def test_interrupted_save_is_ignored_by_restore(tmp_path):
    mesh = make_mesh({"fsdp": 8})
    state, abstract, sh, _ = _setup(mesh)
    d = tmp_path / "ckpt"
    with CheckpointManager(d, async_save=False) as ckpt:
        ckpt.save(1, state.replace(step=jnp.asarray(1, jnp.int32)))
        ckpt.save(2, state.replace(step=jnp.asarray(2, jnp.int32)))
    # A run killed during the save of step 3: orbax had written (part of) the step into its temporary directory but
    # not yet renamed it to `3/`. Simulate it with a copy of a real step under the temporary name, minus the commit
    # marker, plus a truncated array file.
    tmp = d / "3.orbax-checkpoint-tmp-1234567890"
    shutil.copytree(d / "2", tmp)
    (tmp / "commit_success.txt").unlink(missing_ok=True)
    for f in sorted((tmp / "state").rglob("*")):
        if f.is_file() and f.stat().st_size > 0 and "ocdbt" in str(f.parent):
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            break
    with CheckpointManager(d) as ckpt:
        assert ckpt.all_steps() == [1, 2] and ckpt.latest_step() == 2
        restored = ckpt.restore(with_shardings(abstract, sh))
        assert restored.step == 2 and int(restored.state.step) == 2
    assert not tmp.exists()  # cleaned up when the manager was opened


def test_skip_existing_step_keep_last_n_and_time_policy(tmp_path):
    mesh = make_mesh({"fsdp": 8})
    state, abstract, sh, _ = _setup(mesh)
    with CheckpointManager(tmp_path / "c", keep=2, every=2) as ckpt:
        assert [ckpt.should_save(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
        for s in (2, 4, 6):
            assert ckpt.save(s, state.replace(step=jnp.asarray(s, jnp.int32)), data_state={"step": s})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [4, 6]
        other = state.replace(params=jax.tree.map(lambda x: x + 1, state.params), step=jnp.asarray(6, jnp.int32))
        assert ckpt.save(6, other) is False  # already there: skipped, not overwritten
        ckpt.wait_until_finished()
        restored = ckpt.restore(with_shardings(abstract, sh), step=6)
        assert _equal(restored.state.params, state.params) and restored.data_state == {"step": 6}
    timed = CheckpointManager(tmp_path / "t", every=0, every_seconds=600)
    try:
        assert not timed.should_save(4)
        # 601 s pass (set back the clock's last mark rather than sleep: a real sub-second interval made the "not
        # again right after a save" check depend on how fast the machine returned from the async save)
        timed._last_save_time -= 601
        assert timed.should_save(5)
        timed.save(5, state)
        assert not timed.should_save(6)
    finally:
        timed.close()


def test_restore_requires_a_sharded_target(tmp_path):
    mesh = make_mesh({"fsdp": 8})
    state, abstract, _, _ = _setup(mesh)
    with CheckpointManager(tmp_path / "c", async_save=False) as ckpt:
        ckpt.save(1, state)
        with pytest.raises(ValueError, match="ShapeDtypeStruct with a sharding"):
            ckpt.restore(abstract)


def test_params_only_checkpoint_round_trip(tmp_path):
    mesh = make_mesh({"data": 2, "fsdp": 4})
    state, abstract, sh, _ = _setup(mesh)
    step_dir = save_params(tmp_path / "params", 7, state.params, metadata={"config_sha": "x"})
    assert step_dir.name == "7" and (step_dir / "params").is_dir()
    mesh2 = make_mesh({"fsdp": 2}, jax.devices()[:2])
    sh2 = train_state_shardings(abstract, build_optimizer(load_config(None, env={}).optim, 10).tx, mesh2, "fsdp")
    target = with_shardings(abstract.params, sh2.params)
    for path in (tmp_path / "params", step_dir):  # the root (latest step) or the step directory
        got = restore_params(path, target)
        assert isinstance(got, nnx.State) and _equal(got, state.params)
        assert got["embed"][...].sharding.mesh == mesh2
    with pytest.raises(FileNotFoundError):
        restore_params(tmp_path / "nothing", target)
