"""The tiny model's forward on 8 simulated CPU devices equals the single-device forward, per rule preset."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dgemma.model.cache import KVCache
from dgemma.model.config import gemma4_26b_a4b, tiny
from dgemma.model.transformer import Transformer, abstract_model
from dgemma.parallel.mesh import make_mesh, resolve_axis_sizes
from dgemma.parallel.rules import get_rules, state_shardings


@pytest.fixture(scope="module")
def reference():
    cfg = tiny(num_experts=8, top_k_experts=2)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, cfg.vocab_size)
    canvas = jax.random.randint(jax.random.key(2), (8, cfg.canvas_length), 0, cfg.vocab_size)
    return model, tokens, canvas


def _run(model, tokens, canvas):
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, tokens, canvas):
        m = nnx.merge(graphdef, state)
        cache = KVCache.init(m.cfg, tokens.shape[0], tokens.shape[1] + 2)
        _, cache = m.encode(tokens, cache)
        return m(tokens), m.logits(m.decode(canvas, cache))

    return f(state, tokens, canvas)


@pytest.mark.parametrize("preset,sizes", [("fsdp", {"data": 2, "fsdp": 4}),
                                          ("experts_on_fsdp", {"data": 2, "fsdp": 4}),
                                          ("fsdp_tp", {"fsdp": 4, "tensor": 2}),
                                          ("ep", {"data": 2, "expert": 4})])
def test_sharded_forward_equals_single_device(reference, preset, sizes):
    model, tokens, canvas = reference
    want_ar, want_dec = _run(model, tokens, canvas)
    mesh = make_mesh(sizes)
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, get_rules(preset))
    sharded_state = jax.device_put(state, shardings)
    sharded = nnx.merge(graphdef, sharded_state)
    # a big parameter really is split over devices (not silently replicated)
    experts = sharded.layers[0].moe.experts.gate[...]
    assert len({str(s.index) for s in experts.addressable_shards}) > 1
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp") if preset != "fsdp_tp" else "fsdp"))
    with jax.set_mesh(mesh):
        got_ar, got_dec = _run(sharded, jax.device_put(tokens, batch_sharding), jax.device_put(canvas, batch_sharding))
    np.testing.assert_allclose(np.asarray(got_ar), np.asarray(want_ar), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got_dec), np.asarray(want_dec), atol=2e-5, rtol=0)


def test_26b_shardings_from_abstract_shapes():
    """No allocation: the 26B-A4B param tree resolves to valid shardings on a 64-device abstract layout."""
    state = nnx.state(abstract_model(gemma4_26b_a4b()))
    mesh = jax.sharding.AbstractMesh((1, 64, 1, 1), ("data", "fsdp", "expert", "tensor"))
    shardings = state_shardings(state, mesh, get_rules("experts_on_fsdp"))
    flat = dict(nnx.to_flat_state(shardings))
    assert flat[("layers", 0, "moe", "experts", "gate")].spec == P("fsdp", None, None)
    assert flat[("embedder", "embedding")].spec == P(None, "fsdp")


def test_mesh_errors_are_clear():
    with pytest.raises(ValueError, match="do not factor"):
        resolve_axis_sizes({"data": 3, "fsdp": -1}, 8)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        resolve_axis_sizes({"data": -1, "fsdp": -1}, 8)
    with pytest.raises(ValueError, match="unknown axis"):
        resolve_axis_sizes({"fsdpp": 8}, 8)
    state = nnx.state(abstract_model(tiny()))  # 4 experts
    with pytest.raises(ValueError, match=r"moe/experts/(gate|up|down) dim 0 \(size 4, logical 'exp'\) is not divisible"):
        state_shardings(state, make_mesh({"fsdp": 8}), get_rules("experts_on_fsdp"))
