"""Expert-parallel MoE dispatch (dgemma.model.moe_ep) on 8 simulated CPU devices equals the single-device MoE:
outputs and gradients (fp32), dropless under adversarial routing, batch invariant, inside the jitted train step;
bad settings fail with one-line errors naming the setting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dgemma.model.config import FULL, tiny
from dgemma.model.moe import MoEBlock
from dgemma.model.transformer import Transformer
from dgemma.parallel.mesh import make_mesh
from dgemma.parallel.rules import get_rules, state_shardings


def _random_block(cfg, seed=0):
    """MoE block with EVERY parameter randomized (norm scales around 1, matrices N(0, 0.2))."""
    graphdef, state = nnx.split(MoEBlock(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(seed)))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [1.0 + 0.5 * jax.random.normal(k, x.shape) if x.ndim == 1 else 0.2 * jax.random.normal(k, x.shape)
              for k, x in zip(keys, leaves)]
    return graphdef, jax.tree.unflatten(treedef, leaves)


def _fwd_and_grads(graphdef, state, residual):
    """(output, grads w.r.t. (params, input), lowered program text) from ONE compiled value_and_grad."""
    def loss(state, residual):
        out = nnx.merge(graphdef, state)(residual)
        return jnp.sum(jnp.sin(out)), out

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)).lower(state, residual)
    (_, out), grads = lowered.compile()(state, residual)
    return out, grads, lowered.as_text()


EP_TOL = 5e-6  # x (max |want| + 1): the sharded sums differ by up to ~4e-7 here (machine- and XLA-dependent); a
# dispatch bug is off by O(1)


def _assert_trees_close(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(w))) + 1.0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol * scale, rtol=0)


@pytest.mark.parametrize("sizes,rules,expert_axis", [
    ({"data": 2, "fsdp": 2, "expert": 2}, "ep", "expert"),  # ep preset: experts on `expert`, `embed` on fsdp
    # experts split over the FSDP devices (EP = FSDP group): the same dispatch on another axis, slow to save a compile
    pytest.param({"data": 2, "fsdp": 4}, "experts_on_fsdp", "fsdp", marks=pytest.mark.slow),
])
def test_ep_block_equals_single_device_outputs_and_gradients(sizes, rules, expert_axis):
    # top-3 of 8 experts: with 2 experts per shard a token can put min(k, E/ep) = 2 slots on one shard (buffer bound)
    cfg = tiny(num_experts=8, top_k_experts=3).with_execution(expert_axis=expert_axis)
    graphdef, state = _random_block(cfg)
    residual = jax.random.normal(jax.random.key(7), (3, 7, cfg.hidden_size))  # 21 tokens: padded to 24 inside
    want, want_grads, _ = _fwd_and_grads(graphdef, state, residual)

    mesh = make_mesh(sizes)
    sharded = jax.device_put(state, state_shardings(state, mesh, get_rules(rules)))
    with jax.set_mesh(mesh):
        assert nnx.merge(graphdef, sharded).experts.expert_parallel()
        got, got_grads, hlo = _fwd_and_grads(graphdef, sharded, residual)
    assert "manual_computation" in hlo  # the shard_map dispatch ran, not the partitioner's version of the local one
    _assert_trees_close(got, want, EP_TOL)
    _assert_trees_close(got_grads, want_grads, EP_TOL)


def test_sharded_dispatch_equals_single_device_and_sorts_only_own_tokens():
    """experts_on_fsdp without an `expert` axis: the per-device dispatch (`moe_impl=sharded`) equals the single-device
    MoE in outputs and gradients; the one-sort "local" dispatch (`auto` there) under the same mesh is equal too, but the
    partitioner gathers the global batch for its sort, so its compiled temporaries are larger."""
    cfg = tiny(num_experts=8, top_k_experts=3)
    graphdef, state = _random_block(cfg)
    residual = jax.random.normal(jax.random.key(7), (8, 30, cfg.hidden_size))  # 240 tokens, 30 per device
    want, want_grads, _ = _fwd_and_grads(graphdef, state, residual)
    mesh = make_mesh({"data": 2, "fsdp": 4})
    sharded = jax.device_put(state, state_shardings(state, mesh, get_rules("experts_on_fsdp")))
    residual = jax.device_put(residual, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"))))
    temp = {}
    for impl in ("sharded", "auto"):
        g = nnx.graphdef(MoEBlock(tiny(num_experts=8, top_k_experts=3).with_execution(moe_impl=impl),
                                  param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
        with jax.set_mesh(mesh):
            assert nnx.merge(g, sharded).experts.dispatch() == ("sharded" if impl == "sharded" else "local")
            got, got_grads, hlo = _fwd_and_grads(g, sharded, residual)
            temp[impl] = jax.jit(lambda s, r: nnx.merge(g, s)(r)).lower(sharded, residual).compile() \
                .memory_analysis().temp_size_in_bytes
        assert ("manual_computation" in hlo) == (impl == "sharded")
        _assert_trees_close(got, want, EP_TOL)
        _assert_trees_close(got_grads, want_grads, EP_TOL)
    assert temp["sharded"] < temp["auto"], temp


def test_sharded_on_one_device_runs_the_local_dispatch():
    """A run config with moe_impl=sharded (the shipped 26B ones) used without a mesh, e.g. sampling on one device:
    nothing to shard, so the local dispatch runs (same numbers) instead of failing."""
    cfg = tiny(num_experts=8, top_k_experts=3).with_execution(moe_impl="sharded")
    graphdef, state = _random_block(cfg)
    block = nnx.merge(graphdef, state)
    assert block.experts.dispatch() == "local"
    with jax.set_mesh(make_mesh({"fsdp": 1}, jax.devices()[:1])):
        assert block.experts.dispatch() == "local"
    residual = jax.random.normal(jax.random.key(7), (2, 5, cfg.hidden_size))
    local = nnx.merge(nnx.graphdef(MoEBlock(tiny(num_experts=8, top_k_experts=3).with_execution(moe_impl="local"),
                                            param_dtype=jnp.float32, rngs=nnx.Rngs(0))), state)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda r: block(r))(residual)),
                                  np.asarray(jax.jit(lambda r: local(r))(residual)))


def test_dropless_and_batch_invariant_when_every_token_picks_one_shard():
    """All tokens route to experts 0 and 1, both on shard 0 of 4: that shard receives every slot of its group.
    A capacity limit would drop slots there; dropless EP equals the local MoE and a row's output does not depend on
    the other rows of the batch."""
    cfg = tiny(num_experts=8, top_k_experts=2)
    graphdef, state = _random_block(cfg)
    router = state["router"]
    router["scale"].value = jnp.abs(router["scale"].value)
    router["proj"].value = router["proj"].value.at[:, :2].set(jnp.abs(router["proj"].value[:, :2]) + 1.0)
    block = nnx.merge(graphdef, state)
    rows = jnp.abs(jax.random.normal(jax.random.key(3), (8, 5, cfg.hidden_size))) + 0.5  # all along (1, ..., 1)
    flat = rows.reshape(-1, cfg.hidden_size)
    _, idx = block.router(flat)
    assert set(np.unique(np.asarray(idx)).tolist()) == {0, 1}  # the adversarial routing took hold

    want = jax.jit(lambda r: block(r))(rows)
    mesh = make_mesh({"data": 2, "expert": 4})
    sharded = nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh, get_rules("ep"))))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda r: sharded(r))
        full = f(rows)
        alone = f(rows[:1])
        with_others = f(jnp.concatenate([rows[:1], rows[1:] * 3.0], axis=0))
    _assert_trees_close(full, want, EP_TOL)
    _assert_trees_close(alone[0], want[0], EP_TOL)
    _assert_trees_close(with_others[0], want[0], EP_TOL)


def test_train_step_under_ep_equals_single_device():
    """The jitted train step (SGD, lr 1: the parameter change IS the gradient) on a randomized one-layer model."""
    import optax

    from dgemma.train.optim import Optimizer, param_paths
    from dgemma.train.state import TrainState, broadcast_prefix, train_state_shardings
    from dgemma.diffusion.ar import ar_loss_fn
    from dgemma.train.step import batch_sharding, make_train_step

    cfg = tiny(vocab_size=32, num_hidden_layers=1, layer_types=(FULL,), num_experts=8)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    leaves = [1.0 + 0.3 * jax.random.normal(k, x.shape) if x.ndim <= 1 else 0.1 * jax.random.normal(k, x.shape)
              for k, x in zip(keys, leaves)]
    params = jax.tree.unflatten(treedef, leaves)
    opt = Optimizer(tx=optax.sgd(1.0), schedule=lambda count: jnp.float32(1.0))
    state0 = TrainState(params=params, opt_state=opt.tx.init(params), step=jnp.zeros((), jnp.int32),
                        rng=jax.random.key_data(jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(6), (8, 12), 0, cfg.vocab_size)
    batch = {"tokens": tokens, "ar_targets": jnp.roll(tokens, -1, axis=1),
             "ar_weight": jnp.ones(tokens.shape, jnp.float32).at[:, -1].set(0.0)}

    def run(mesh, rules):
        shardings = train_state_shardings(jax.eval_shape(lambda: state0), opt.tx, mesh, rules)
        state = jax.device_put(jax.tree.map(jnp.copy, state0), broadcast_prefix(shardings, state0))
        step = make_train_step(graphdef, opt, ar_loss_fn, mesh=mesh, shardings=shardings, donate=False)
        with jax.set_mesh(mesh):
            new, metrics = step(state, jax.device_put(batch, batch_sharding(mesh)))
        grads = jax.tree.map(lambda before, after: before - after, state.params, new.params)
        return grads, {k: float(v) for k, v in metrics.items()}, new

    g1, m1, _ = run(make_mesh({"fsdp": 1}, jax.devices()[:1]), "fsdp")
    g8, m8, s8 = run(make_mesh({"data": 2, "expert": 4}), "ep")
    for key in ("loss", "grad_norm"):
        assert m8[key] == pytest.approx(m1[key], abs=1e-6, rel=1e-5), key
    for path, a, b in zip(param_paths(g1), jax.tree.leaves(g1), jax.tree.leaves(g8)):
        scale = float(np.max(np.abs(np.asarray(a)))) + 1e-3
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5 * scale, rtol=0, err_msg=path)
    expert_grad = np.asarray(g1["layers"][0]["moe"]["experts"]["gate"][...])
    assert np.abs(expert_grad).max() > 1e-3  # the experts really receive gradient (the check is not vacuous)
    gate = s8.params["layers"][0]["moe"]["experts"]["gate"][...]
    assert len({str(s.index) for s in gate.addressable_shards}) == 4  # experts really split over the expert axis


def test_bad_settings_fail_with_one_line_errors():
    cfg = tiny(num_experts=4).with_execution(moe_impl="ep")
    graphdef, state = _random_block(cfg)
    residual = jnp.ones((2, 4, cfg.hidden_size))
    f = jax.jit(lambda s, r: nnx.merge(graphdef, s)(r))
    with jax.set_mesh(make_mesh({"expert": 3}, jax.devices()[:3])):
        with pytest.raises(ValueError) as err:
            f(state, residual)
    first = str(err.value).splitlines()[0]  # jax appends its traceback note on later lines
    assert first.startswith("model.num_experts=4 is not divisible by mesh axis model.execution.expert_axis='expert' "
                            "of size 3")
    with pytest.raises(ValueError) as err:
        f(state, residual)
    first = str(err.value).splitlines()[0]
    assert first.startswith("model.execution.moe_impl='ep' needs an active mesh (jax.set_mesh) with axis "
                            "model.execution.expert_axis='expert'; active mesh axes: none")
    with pytest.raises(ValueError, match=r"ExecutionConfig\.moe_impl: 'expert' is not one of"):
        tiny().with_execution(moe_impl="expert")
    # the default ("auto") keeps the single-device path without a mesh and on meshes whose expert axis is 1
    experts = MoEBlock(tiny(), param_dtype=jnp.float32, rngs=nnx.Rngs(0)).experts
    assert not experts.expert_parallel()
    with jax.set_mesh(make_mesh({"fsdp": 8})):
        assert not experts.expert_parallel()


def test_planner_terms_follow_the_dispatch_formula():
    from dgemma.model.config import gemma4_26b_a4b
    from dgemma.planning.expert_parallel import ep_axis_size, ep_plan_terms
    from dgemma.planning.planner import PlanSpec

    m = gemma4_26b_a4b().with_execution(dtype="bfloat16")
    spec = PlanSpec(model=m, rules="ep", mesh={"data": 1, "fsdp": 1, "expert": 8, "tensor": 1}, global_batch=8,
                    prompt_len=1024, response_len=1024)  # stage 1: T = 1024 + 2 x 1024 per example
    terms = ep_plan_terms(spec)
    n, H, k, r = 3072, 2816, 8, 7
    assert (terms["ep"], terms["tokens_per_device"], terms["forward_passes"]) == (8, n, 2)  # + self-conditioning
    fwd, bwd = r * n * (H * 2 + 8 * k + H * 4), r * n * (H * 2 + 4 * k + H * 4)
    assert sum(terms["per_layer"].values()) == fwd + bwd == 2 * r * n * H * (2 + 4) + 12 * r * n * k
    assert terms["collective_bytes_per_step"] == 30 * (2 * fwd + bwd)
    assert terms["gathered_expert_bytes"] == 3 * 16 * H * 704 * 4
    assert ep_axis_size(m, {"fsdp": 8, "expert": 1}) is None  # auto: no expert axis, single-sort MoE
    assert ep_axis_size(m.with_execution(expert_axis="fsdp"), {"fsdp": 8}) == 8
    assert ep_plan_terms(PlanSpec(model=m.with_execution(moe_impl="local"), rules="ep", mesh=spec.mesh, global_batch=8,
                                  prompt_len=1024, response_len=1024)) is None
