"""The jitted train step: 1-device vs 8-device mesh equality, explicit shardings, donation, gradient accumulation,
and the AR loss reduction."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dgemma.config import load_config
from dgemma.data.config import LayoutConfig, DataConfig
from dgemma.data.pipeline import DataPipeline, to_global_batch
from dgemma.model.config import FULL, SLIDING, tiny
from dgemma.model.layers import param
from dgemma.model.transformer import Transformer
from dgemma.parallel.mesh import make_mesh
from dgemma.train.optim import build_optimizer, param_paths
from dgemma.train.state import (abstract_train_state, broadcast_prefix, init_train_state, train_state_shardings)
from dgemma.diffusion.ar import ar_loss_fn
from dgemma.train.step import batch_sharding, make_train_step

MODEL = tiny(vocab_size=32, num_hidden_layers=2, layer_types=(SLIDING, FULL), num_experts=8)


def _optim(**kw):
    return load_config(None, {f"optim.{k}": v for k, v in kw.items()}, env={}).optim


def _data(batch_size=8):
    cfg = DataConfig(layout=LayoutConfig(prompt_len=16, canvas_length=8, n_blocks=2), batch_size=batch_size,
                     num_threads=0, seed=1)
    return DataPipeline(cfg, process_index=0, process_count=1)


def _run(mesh, state, graphdef, opt, shardings, data, steps=3):
    full = broadcast_prefix(shardings, state)
    state = jax.device_put(jax.tree.map(jnp.copy, state), full)
    step = make_train_step(graphdef, opt, ar_loss_fn, mesh=mesh, shardings=shardings)
    losses = []
    for s in range(steps):
        batch = to_global_batch(data.batch(s), batch_sharding(mesh))
        with jax.set_mesh(mesh):
            state, metrics = step(state, batch)
        losses.append({k: float(v) for k, v in metrics.items()})
    return state, losses


def test_one_device_and_eight_device_mesh_give_the_same_steps():
    # Adam divides by sqrt(v) + eps, so a gradient's fp reduction-order noise dg (different on 1 vs 8 devices) moves a
    # param by up to lr * dg / eps. Experts that received few tokens have near-zero grads; with eps=1e-8 this gives
    # ~3e-5 differences after 3 steps (measured), with eps=1e-4 ~4e-7. A real sharding bug moves params by ~lr = 1e-3.
    opt = build_optimizer(_optim(lr=1e-3, eps=1e-4, warmup_steps=1, weight_decay=0.01), total_steps=10)
    factory = lambda rngs: Transformer(MODEL, rngs=rngs)  # noqa: E731
    graphdef, state = init_train_state(factory, opt.tx, seed=0)
    _, abstract = abstract_train_state(factory, opt.tx, seed=0)
    data = _data()

    mesh1 = make_mesh({"fsdp": 1}, jax.devices()[:1])
    mesh8 = make_mesh({"data": 2, "fsdp": 4})
    sh1 = train_state_shardings(abstract, opt.tx, mesh1, "fsdp")
    sh8 = train_state_shardings(abstract, opt.tx, mesh8, "fsdp")
    s1, l1 = _run(mesh1, state, graphdef, opt, sh1, data)
    s8, l8 = _run(mesh8, state, graphdef, opt, sh8, data)

    for a, b in zip(l1, l8):
        for k in ("loss", "grad_norm", "ar_accuracy", "lr"):
            assert a[k] == pytest.approx(b[k], abs=1e-5, rel=1e-5), k
    assert l1[0]["loss"] != l1[2]["loss"]  # it trained
    assert int(s1.step) == int(s8.step) == 3
    paths = param_paths(s1.params)
    for path, a, b in zip(paths, jax.tree.leaves(s1.params), jax.tree.leaves(s8.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=path)
    for a, b in zip(jax.tree.leaves(s1.opt_state), jax.tree.leaves(s8.opt_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)

    # the output state keeps the explicit shardings: a big weight is really split over the 8 devices
    flat = dict(zip(paths, jax.tree.leaves(s8.params)))
    emb = flat["embedder/embedding"]
    assert emb.sharding.spec == P(None, "fsdp") and len({str(s.index) for s in emb.addressable_shards}) == 4
    mu = [x for x in jax.tree.leaves(s8.opt_state) if x.shape == emb.shape][0]  # Adam moment follows its param
    assert mu.sharding.is_equivalent_to(emb.sharding, emb.ndim)
    assert s8.step.sharding.is_fully_replicated


def test_state_is_donated_and_scalars_replicated():
    opt = build_optimizer(_optim(lr=1e-2, warmup_steps=0), total_steps=5)
    mesh = make_mesh({"data": 2, "fsdp": 4})

    class Lin(nnx.Module):
        def __init__(self, rngs):
            self.w = param(rngs, (8, 16), ("embed", "mlp"), jnp.float32)

        def __call__(self, x):
            return x @ self.w[...]

    def loss_fn(model, batch, rng):
        noise = jax.random.normal(rng, batch["x"].shape)
        return jnp.mean((model(batch["x"] + 0.0 * noise) - batch["y"]) ** 2), {"noise_mean": noise.mean()}

    factory = lambda rngs: Lin(rngs)  # noqa: E731
    _, abstract = abstract_train_state(factory, opt.tx)
    sh = train_state_shardings(abstract, opt.tx, mesh, "fsdp")
    graphdef, state = init_train_state(factory, opt.tx, 0, sh)
    step = make_train_step(graphdef, opt, loss_fn, mesh=mesh, shardings=sh)
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 8)).astype(np.float32), "y": rng.normal(size=(8, 16)).astype(np.float32)}
    batch = to_global_batch(batch, batch_sharding(mesh))
    old_w = jax.tree.leaves(state.params)[0]
    new, m1 = step(state, batch)
    assert old_w.is_deleted()  # donated
    new, m2 = step(new, batch)
    assert m1["noise_mean"] != m2["noise_mean"]  # the step's rng is fold_in(base, step)
    assert jax.tree.leaves(new.params)[0].sharding.spec == P("fsdp", None)
    assert all(m.sharding.is_fully_replicated for m in jax.tree.leaves(m2))


def test_grad_accumulation_matches_one_big_batch():
    opt = build_optimizer(_optim(lr=1e-2, warmup_steps=0, eps=1e-6), total_steps=5)
    mesh = make_mesh({"data": 2, "fsdp": 2}, jax.devices()[:4])

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = param(rngs, (6, 32), ("embed", "mlp"), jnp.float32, std=0.3)
            self.b = param(rngs, (32, 6), ("mlp", "embed"), jnp.float32, std=0.3)

        def __call__(self, x):
            return jnp.tanh(x @ self.a[...]) @ self.b[...]

    def loss_fn(model, batch, rng):
        per_example = jnp.mean((model(batch["x"]) - batch["y"]) ** 2, axis=-1)
        return per_example.mean(), {"max": per_example.max()}

    factory = lambda rngs: MLP(rngs)  # noqa: E731
    _, abstract = abstract_train_state(factory, opt.tx)
    sh = train_state_shardings(abstract, opt.tx, mesh, "fsdp")
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(16, 6)).astype(np.float32), "y": rng.normal(size=(16, 6)).astype(np.float32)}
    results = []
    for k in (1, 4):
        graphdef, state = init_train_state(factory, opt.tx, 0, sh)
        step = make_train_step(graphdef, opt, loss_fn, mesh=mesh, shardings=sh, grad_accum_steps=k)
        for _ in range(2):
            state, metrics = step(state, to_global_batch(batch, batch_sharding(mesh)))
        results.append((state, metrics))
    (s1, m1), (s4, m4) = results
    assert float(m1["loss"]) == pytest.approx(float(m4["loss"]), rel=1e-5)
    assert float(m1["grad_norm"]) == pytest.approx(float(m4["grad_norm"]), rel=1e-4)
    assert float(m4["max"]) < float(m1["max"])  # aux metrics are micro-batch means (a max of 4 is not the max)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    with pytest.raises(ValueError, match="not divisible by grad_accum_steps=3"):
        make_train_step(graphdef, opt, loss_fn, grad_accum_steps=3)(s4, {k: jnp.asarray(v) for k, v in batch.items()})


def test_ar_loss_is_per_example_mean_then_mean_over_supervised_examples():
    V = 5
    logits = jnp.log(jnp.array([[[0.5, 0.5, 1e-9, 1e-9, 1e-9]] * 3,
                                [[0.25, 0.25, 0.25, 0.25, 1e-9]] * 3,
                                [[0.2] * 5] * 3]))

    class Fixed:
        """Hidden states = the logits and an identity head without soft-cap, so logits pass through unchanged."""

        class cfg:
            final_logit_softcapping = 0.0
            sliding_window = 4
            class execution:
                attention_impl = "dense"  # the masks are built as the reference [B, T, T] arrays

        class embedder:
            embedding = jnp.eye(V)

        def forward(self, tokens, positions, masks):
            return logits, []

    batch = {"tokens": jnp.zeros((3, 3), jnp.int32), "ar_targets": jnp.zeros((3, 3), jnp.int32),
             "ar_weight": jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])}
    loss, aux = ar_loss_fn(Fixed(), batch, jax.random.key(0))
    # row 0: -log 0.5 (1 token); row 1: -log 0.25 (3 tokens); row 2 has no weight and is excluded
    want = (np.log(2.0) + np.log(4.0)) / 2
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert float(aux["ar_tokens"]) == 4.0
    tok = optax.softmax_cross_entropy_with_integer_labels(logits[:2, 0], jnp.zeros(2, jnp.int32))
    assert float(tok.mean()) == pytest.approx(want, rel=1e-5)
    assert V == logits.shape[-1]


def test_batch_sharding_spec():
    mesh = make_mesh({"data": 2, "fsdp": 4})
    s = batch_sharding(mesh)
    assert isinstance(s, NamedSharding) and s.spec == P(("data", "fsdp"))
