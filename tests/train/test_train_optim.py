"""Optimizer from the config: schedule values, weight-decay mask, clipping, and freezing by path regex."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dgemma.config import load_config
from dgemma.model.layers import param
from dgemma.train.optim import (build_optimizer, decay_mask, frozen_flags, make_schedule, param_labels,
                                param_paths)
from dgemma.train.state import init_train_state
from dgemma.train.step import make_train_step


def _optim(**overrides):
    return load_config(None, {f"optim.{k}": v for k, v in overrides.items()}, env={}).optim


# MARK: schedule ----------------------------------------------------------------------------------------------------
def test_warmup_cosine_values_at_key_steps():
    f = make_schedule(1.0, 110, warmup_steps=10, kind="cosine", min_lr_ratio=0.1)
    lr = lambda s: float(f(s))  # noqa: E731
    assert lr(0) == pytest.approx(0.1)  # step 0 already trains, at peak / warmup
    assert lr(4) == pytest.approx(0.5)
    assert lr(9) == pytest.approx(1.0)  # peak reached at the last warmup step
    assert lr(10) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr(60) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-6)  # halfway through the decay
    assert lr(110) == pytest.approx(0.1)  # floor = lr * min_lr_ratio
    assert lr(500) == pytest.approx(0.1)  # and it stays there
    values = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay


def test_constant_schedule_and_warmup_as_long_as_the_run():
    c = make_schedule(2.0, 50, warmup_steps=4, kind="constant")
    assert [float(c(s)) for s in (0, 1, 3, 4, 49)] == pytest.approx([0.5, 1.0, 2.0, 2.0, 2.0])
    # warmup == run length: the run reaches the peak on its last update
    w = make_schedule(1.0, 5, warmup_steps=5, kind="cosine", min_lr_ratio=0.0)
    assert [float(w(s)) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    with pytest.raises(ValueError, match="warmup_steps=6 exceeds total_steps=5"):
        make_schedule(1.0, 5, warmup_steps=6)
    z = make_schedule(1.0, 4, warmup_steps=0, kind="cosine", min_lr_ratio=0.0)
    assert float(z(0)) == pytest.approx(1.0) and float(z(2)) == pytest.approx(0.5) and float(z(4)) == pytest.approx(0.0)


def test_optimizer_uses_the_schedule_from_config():
    opt = build_optimizer(_optim(lr=0.5, warmup_steps=2, schedule="constant", clip_norm=None, weight_decay=0.0,
                                 b1=0.0, b2=0.0, eps=1e-12), total_steps=10)
    params = {"w": jnp.ones((2, 2))}
    state = opt.tx.init(params)
    grads = {"w": jnp.full((2, 2), 3.0)}
    u0, state = opt.tx.update(grads, state, params)
    u1, state = opt.tx.update(grads, state, params)
    # b1 = b2 = 0: Adam's update is lr * sign(g); step 0 uses lr * 1/2, step 1 the peak
    np.testing.assert_allclose(np.asarray(u0["w"]), -0.25, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(u1["w"]), -0.5, rtol=1e-5)


# MARK: masks ---------------------------------------------------------------------------------------------------------
class Toy(nnx.Module):
    """Paths: embedder/embedding, router/proj, router/scale, mlp/w, norm/scale."""

    def __init__(self, rngs):
        self.embedder = nnx.Dict(embedding=param(rngs, (8, 4), ("vocab", "embed"), jnp.float32))
        self.router = nnx.Dict(proj=param(rngs, (4, 3), ("embed", "exp"), jnp.float32),
                                scale=param(rngs, (4,), ("embed",), jnp.float32, init="ones"))
        self.mlp = nnx.Dict(w=param(rngs, (4, 4), ("embed", "mlp"), jnp.float32))
        self.norm = nnx.Dict(scale=param(rngs, (4,), ("embed",), jnp.float32, init="ones"))

    def __call__(self, tokens):
        x = self.embedder["embedding"][...][tokens] * self.norm["scale"][...]
        x = x + jax.nn.gelu(x @ self.mlp["w"][...])
        gate = jax.nn.softmax((x * self.router["scale"][...]) @ self.router["proj"][...], axis=-1)
        return x @ self.embedder["embedding"][...].T + 2.0 * gate[..., :1]


def _toy_params():
    return nnx.state(Toy(nnx.Rngs(0)), nnx.Param)


def test_param_paths_and_masks():
    params = _toy_params()
    paths = param_paths(params)
    assert sorted(paths) == ["embedder/embedding", "mlp/w", "norm/scale", "router/proj", "router/scale"]
    flags = dict(zip(paths, frozen_flags(params, (r".*router.*",))))
    assert flags == {"embedder/embedding": False, "mlp/w": False, "norm/scale": False, "router/proj": True,
                     "router/scale": True}
    labels = dict(zip(paths, jax.tree.leaves(param_labels(params, ("embedder.*",)))))
    assert labels["embedder/embedding"] == "frozen" and labels["mlp/w"] == "trainable"
    decay = dict(zip(paths, jax.tree.leaves(decay_mask(params))))
    assert decay == {"embedder/embedding": True, "mlp/w": True, "norm/scale": False, "router/proj": True,
                     "router/scale": False}
    assert not dict(zip(paths, jax.tree.leaves(decay_mask(params, decay_embeddings=False))))["embedder/embedding"]


def test_weight_decay_skips_1d_params():
    opt = build_optimizer(_optim(lr=0.1, weight_decay=0.5, warmup_steps=0, schedule="constant", clip_norm=None),
                          total_steps=10)
    params = _toy_params()
    state = opt.tx.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.tx.update(zero, state, params)  # zero grads: only weight decay moves params
    got = dict(zip(param_paths(params), jax.tree.leaves(updates)))
    assert float(jnp.abs(got["norm/scale"]).max()) == 0.0 and float(jnp.abs(got["router/scale"]).max()) == 0.0
    mlp = dict(zip(param_paths(params), jax.tree.leaves(params)))["mlp/w"]
    np.testing.assert_allclose(np.asarray(got["mlp/w"]), -0.1 * 0.5 * np.asarray(mlp), rtol=1e-5)


def test_clipping_uses_trainable_grads_only():
    # eps >> |g| makes Adam's first update ~ -lr * g / eps, i.e. linear in the (clipped) gradient
    common = dict(lr=1.0, b1=0.0, b2=0.0, eps=1e3, schedule="constant", warmup_steps=0, weight_decay=0.0)
    params = {"a": jnp.zeros((2,)), "router": jnp.zeros((2,))}
    grads = {"a": jnp.array([3.0, 4.0]), "router": jnp.array([1e6, 1e6])}
    opt = build_optimizer(_optim(clip_norm=1.0, freeze=["router"], **common), total_steps=5)
    u, _ = opt.tx.update(grads, opt.tx.init(params), params)
    assert float(jnp.abs(u["router"]).max()) == 0.0
    # clipped over the trainable grads only: [3, 4] (norm 5) -> [0.6, 0.8]; the frozen 1e6 grads play no part
    np.testing.assert_allclose(np.asarray(u["a"]), -np.array([0.6, 0.8]) / (np.array([0.6, 0.8]) + 1e3), rtol=1e-4)
    no_clip = build_optimizer(_optim(clip_norm=None, freeze=["router"], **common), total_steps=5)
    u, _ = no_clip.tx.update(grads, no_clip.tx.init(params), params)
    np.testing.assert_allclose(np.asarray(u["a"]), -np.array([3.0, 4.0]) / (np.array([3.0, 4.0]) + 1e3), rtol=1e-4)


# MARK: freezing through the train step -------------------------------------------------------------------------------
def _toy_loss(model, batch, rng):
    logits = model(batch["tokens"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    return loss, {}


@pytest.mark.parametrize("freeze", [(r".*router.*",), (r"embedder.*",)])
def test_frozen_params_stay_bit_identical_while_others_change(freeze):
    opt = build_optimizer(_optim(lr=0.05, weight_decay=0.1, warmup_steps=0, freeze=list(freeze)), total_steps=10)
    graphdef, state = init_train_state(lambda rngs: Toy(rngs), opt.tx, seed=0)
    # a frozen leaf holding -0.0 keeps its sign bit too (`p + 0.0` outside XLA's simplifier would flip it)
    leaves, treedef = jax.tree.flatten(state.params)
    flags = frozen_flags(state.params, freeze)
    leaves = [x.at[0].set(-0.0) if f else x for x, f in zip(leaves, flags)]
    state = state.replace(params=jax.tree.unflatten(treedef, leaves))
    before = [np.asarray(x).copy() for x in jax.tree.leaves(state.params)]
    step = make_train_step(graphdef, opt, _toy_loss)
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = {"tokens": jnp.asarray(rng.integers(0, 8, (4, 5))), "targets": jnp.asarray(rng.integers(0, 8, (4, 5)))}
        state, metrics = step(state, batch)
    assert int(state.step) == 3 and np.isfinite(float(metrics["loss"]))
    after = [np.asarray(x) for x in jax.tree.leaves(state.params)]
    for path, f, b, a in zip(param_paths(state.params), flags, before, after):
        if f:
            assert a.tobytes() == b.tobytes(), f"frozen {path} changed"
        else:
            assert not np.array_equal(a, b), f"trainable {path} did not change"
    # no optimizer moments are allocated for frozen parameters
    n_moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    n_trainable = sum(x.size for x, f in zip(after, flags) if not f)
    assert n_moments == 2 * n_trainable


def test_warmup_longer_than_the_run_is_refused_naming_both_numbers():
    from dgemma.config import ConfigError

    build_optimizer(_optim(warmup_steps=12), total_steps=12)  # exactly the run: fine
    with pytest.raises(ConfigError) as info:
        build_optimizer(_optim(warmup_steps=20), total_steps=12)
    msg = str(info.value)
    assert "optim.warmup_steps=20 exceeds the 12 optimizer updates" in msg and len(msg.splitlines()) == 1

