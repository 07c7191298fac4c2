"""FSDP keeps the activations on the batch (dgemma.model.activation_sharding): on 8 simulated CPU devices the
compiled gradient of an unscanned twin (per-layer embeddings, KV sharing) holds no activation over the global batch,
gives the single-device loss and gradient, and needs less scratch memory than with the constraints switched off."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from dgemma.model import activation_sharding, per_layer_embeddings, transformer
from dgemma.model.config import tiny_31b, tiny_e2b
from dgemma.model.transformer import Transformer
from dgemma.parallel.mesh import make_mesh
from dgemma.parallel.rules import get_rules, state_shardings

B, T = 16, 24  # 2 examples per device on fsdp = 8


def _compiled_grad(cfg, sharded: bool):
    """(compiled text, temp bytes, loss, grads) of d/dparams mean(logits^2) with params FSDP-sharded."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)

    def loss(state, tokens):
        return jnp.mean(nnx.merge(graphdef, state)(tokens).astype(jnp.float32) ** 2)  # AR logits [B, T, V]

    step = jax.jit(jax.value_and_grad(loss))
    if not sharded:
        value, grads = step(state, tokens)
        return None, None, value, grads
    mesh = make_mesh({"fsdp": 8})
    state = jax.device_put(state, state_shardings(state, mesh, get_rules("fsdp")))
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("fsdp")))
    with jax.set_mesh(mesh):
        compiled = step.lower(state, tokens).compile()
        value, grads = compiled(state, tokens)
    return compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes, value, grads


def _global_batch_activations(text: str, hidden: int) -> list[str]:
    """Values [B, T, ...] of the whole global batch, at least a hidden row per token, in the per-device program.
    The table lookups' column shards are not among them: with the ids gathered, each device looks up its own
    columns of every row ([B, T, columns / 8], as many bytes as its own rows at full width) and sends them on."""
    shapes = set(re.findall(rf"(?:f32|bf16)\[{B},{T}(?:,\d+)*\]", text))
    return sorted(s for s in shapes if math.prod(int(d) for d in re.findall(r"\d+", s.split("[")[1])[2:]) >= hidden)


@pytest.mark.parametrize("twin", [tiny_e2b, tiny_31b], ids=["tiny_e2b", "tiny_31b"])
def test_fsdp_activations_stay_on_the_batch(twin, monkeypatch):
    cfg = twin().with_execution(dtype="float32")
    text, temp, value, grads = _compiled_grad(cfg, sharded=True)
    assert _global_batch_activations(text, cfg.hidden_size) == []  # every device holds its own 2 examples only
    _, _, want_value, want_grads = _compiled_grad(cfg, sharded=False)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    # without the constraints the partitioner follows the tables' column sharding: the batch is replicated
    for module in (transformer, per_layer_embeddings):
        monkeypatch.setattr(module, "batch_sharded", lambda x: x)
    text_off, temp_off, _, _ = _compiled_grad(cfg, sharded=True)
    assert _global_batch_activations(text_off, cfg.hidden_size)
    assert temp < temp_off


def test_batch_sharded_is_the_identity_where_it_cannot_apply():
    x = jnp.ones((6, 4))
    assert activation_sharding.batch_sharded(x) is x  # no active mesh
    with jax.set_mesh(make_mesh({"fsdp": 8})):
        assert activation_sharding.batch_sharded(x) is x  # 6 rows do not split over 8 devices
