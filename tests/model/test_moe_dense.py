"""`model.execution.moe_kernel="dense"` (every expert on every token, weighted 0 off the top k) computes the function
of the sorted ragged_dot dispatch: same MoE outputs and parameter gradients, same model loss, to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model.config import tiny_toy
from dgemma.model.moe import Experts, MoEBlock
from dgemma.model.transformer import Transformer


def _block_value_and_grads(kernel: str, x):
    cfg = tiny_toy().with_execution(moe_kernel=kernel)
    block = MoEBlock(cfg, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(block)

    def loss(p):
        out = nnx.merge(graphdef, p)(x)
        return jnp.sum(jnp.sin(out)), out

    (value, out), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, out, grads


def test_dense_experts_match_the_sorted_dispatch_in_outputs_and_gradients():
    x = jax.random.normal(jax.random.key(1), (2, 24, tiny_toy().hidden_size), jnp.float32)
    v_ref, out_ref, g_ref = _block_value_and_grads("xla", x)
    v, out, g = _block_value_and_grads("dense", x)
    assert float(jnp.max(jnp.abs(out_ref))) > 0.1  # a non-trivial output
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
    flat_ref, flat = jax.tree.leaves(nnx.to_pure_dict(g_ref)), jax.tree.leaves(nnx.to_pure_dict(g))
    assert len(flat) == len(flat_ref) and all(float(jnp.max(jnp.abs(r))) > 0 for r in flat_ref)  # router included
    for a, b in zip(flat, flat_ref):  # float32 rounding relative to each gradient's scale
        assert float(jnp.max(jnp.abs(a - b))) <= 2e-5 * float(jnp.max(jnp.abs(b)))


def test_dense_experts_model_logits_match():
    tokens = jax.random.randint(jax.random.key(2), (2, 20), 2, 32)
    ref = Transformer(tiny_toy(), rngs=nnx.Rngs(0))
    dense = Transformer(tiny_toy().with_execution(moe_kernel="dense"), rngs=nnx.Rngs(0))
    a, b = ref(tokens), dense(tokens)
    a, b = (a[0] if isinstance(a, tuple) else a), (b[0] if isinstance(b, tuple) else b)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_dense_experts_refuse_a_dispatch_they_do_not_run():
    experts = Experts(4, 16, 8, param_dtype=jnp.float32, rngs=nnx.Rngs(0), impl="ep", kernel="dense")
    x = jnp.ones((3, 16))
    with pytest.raises(ValueError, match="moe_kernel='dense'.*'ep'"):
        experts(x, jnp.full((3, 2), 0.5), jnp.array([[0, 1], [1, 2], [2, 3]]))


def test_the_planner_counts_dense_experts_as_dense_on_an_accelerator():
    """An accelerator plan of `moe_kernel=dense` counts every expert (as XLA's dense expansion), never the routed
    work; without an accelerator the planner keeps "ragged" (as for every kernel)."""
    from pathlib import Path

    from dgemma.config import load_config
    from dgemma.planning.plan_config import spec_from_config

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs/stage1/gemma4_26b_a4b.yaml"),
                      ["model.execution.moe_kernel=dense"], env={})
    assert spec_from_config(cfg, devices=32, accelerator="v5p").moe_lowering == "dense"
    assert spec_from_config(cfg, devices=32, accelerator="h100").moe_lowering == "dense"
    assert spec_from_config(cfg, devices=32, accelerator=None).moe_lowering == "ragged"
