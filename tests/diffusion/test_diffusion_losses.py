"""Chunked cross-entropy from hidden states vs a naive full-logits CE (docs/stage1.md §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.diffusion.losses import ce_from_hidden, per_example_mean, token_nll_from_hidden


def naive_ce(hidden, embedding, targets, weights, softcap=30.0):
    logits = jnp.einsum("bth,vh->btv", hidden.astype(jnp.float32), embedding.astype(jnp.float32))
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.clip(targets, 0, embedding.shape[0] - 1)[..., None], axis=-1)[..., 0]
    w = weights.astype(jnp.float32)
    per_ex = jnp.sum(nll * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1e-30)
    has = jnp.sum(w, axis=1) > 0
    return jnp.sum(jnp.where(has, per_ex, 0.0)) / jnp.sum(has), nll


_ce = jax.jit(ce_from_hidden, static_argnames=("softcap", "chunk"))


def make_inputs(seed=0, b=4, t=37, h=16, v=101, scale=3.0):
    k = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(k[0], (b, t, h)) * scale
    emb = jax.random.normal(k[1], (v, h))
    targets = jax.random.randint(k[2], (b, t), 0, v)
    weights = jax.random.uniform(k[3], (b, t)) * (jax.random.uniform(k[3], (b, t), minval=-1) > 0)
    weights = weights.at[2].set(0.0)  # an example without supervised tokens is excluded, not averaged in as 0
    targets = targets.at[0, :3].set(-100)  # ignore-index style targets at masked positions are harmless
    weights = weights.at[0, :3].set(0.0)
    return hidden, emb, targets, weights


@pytest.mark.parametrize("chunk", [5, 37, 512])
@pytest.mark.parametrize("softcap", [30.0, None])
def test_chunked_ce_matches_naive(chunk, softcap):
    hidden, emb, targets, weights = make_inputs()
    got = _ce(hidden, emb, targets, weights, softcap=softcap, chunk=chunk)
    want, nll = naive_ce(hidden, emb, targets, weights, softcap)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-5)
    tok = jax.jit(token_nll_from_hidden, static_argnames=("softcap", "chunk"))(
        hidden, emb, targets, softcap=softcap, chunk=chunk
    )
    np.testing.assert_allclose(np.asarray(tok), np.asarray(nll), rtol=1e-5, atol=1e-5)
    # the softcap matters at this logit scale (so the check above can fail)
    if softcap is not None:
        other, _ = naive_ce(hidden, emb, targets, weights, None)
        assert abs(float(other) - float(want)) > 1e-2


def test_chunked_ce_gradients_match_naive():
    hidden, emb, targets, weights = make_inputs(seed=1)
    f_chunk = lambda hh, ee: ce_from_hidden(hh, ee, targets, weights, chunk=16)  # noqa: E731
    f_naive = lambda hh, ee: naive_ce(hh, ee, targets, weights)[0]  # noqa: E731
    g_chunk = jax.jit(jax.grad(f_chunk, argnums=(0, 1)))(hidden, emb)
    g_naive = jax.grad(f_naive, argnums=(0, 1))(hidden, emb)
    for a, b in zip(g_chunk, g_naive):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(g_chunk[0])[2] == 0)  # unweighted example gets no gradient


def test_chunked_ce_bf16_hidden():
    hidden, emb, targets, weights = make_inputs(seed=2)
    hb, eb = hidden.astype(jnp.bfloat16), emb.astype(jnp.bfloat16)
    got = ce_from_hidden(hb, eb, targets, weights, chunk=8)
    want, _ = naive_ce(hb.astype(jnp.float32), eb.astype(jnp.float32), targets, weights)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-5)



def test_head_reads_fp32_table_in_the_activation_dtype():
    """bf16 activations with fp32 master weights (the 26B runs): the head uses the table rounded to bf16, like the
    model's `decode` (the sampler), with fp32 accumulation; the table's gradient comes back in fp32."""
    hidden, emb, targets, weights = make_inputs(seed=3)
    hb = hidden.astype(jnp.bfloat16)
    got = token_nll_from_hidden(hb, emb, targets, chunk=8)
    rounded = token_nll_from_hidden(hb, emb.astype(jnp.bfloat16).astype(jnp.float32), targets, chunk=8)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rounded))
    want, _ = naive_ce(hb.astype(jnp.float32), emb.astype(jnp.bfloat16).astype(jnp.float32), targets, weights)
    np.testing.assert_allclose(float(ce_from_hidden(hb, emb, targets, weights, chunk=8)), float(want), rtol=1e-5)
    grad = jax.grad(lambda e: ce_from_hidden(hb, e, targets, weights, chunk=8))(emb)
    assert grad.dtype == jnp.float32 and float(jnp.abs(grad).max()) > 0

def test_per_example_mean_and_masked_nan():
    values = jnp.array([[1.0, 2.0, jnp.nan], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    weights = jnp.array([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mean, has = per_example_mean(values, weights)
    np.testing.assert_allclose(np.asarray(mean), [1.75, 0.0, 8.0])
    np.testing.assert_array_equal(np.asarray(has), [True, False, True])


def test_chunked_ce_does_not_materialize_full_logits():
    b, t, h, v = 4, 512, 32, 8192  # full fp32 logits would be 64 MiB
    hidden = jnp.zeros((b, t, h), jnp.float32)
    emb = jnp.zeros((v, h), jnp.float32)
    targets = jnp.zeros((b, t), jnp.int32)
    weights = jnp.ones((b, t), jnp.float32)
    full = b * t * v * 4
    fn = jax.jit(jax.value_and_grad(lambda hh, ee: ce_from_hidden(hh, ee, targets, weights, chunk=8), argnums=(0, 1)))
    mem = fn.lower(hidden, emb).compile().memory_analysis()
    if mem is None:
        pytest.skip("memory_analysis unavailable on this backend")
    chunk_logits = b * 8 * v * 4
    assert mem.temp_size_in_bytes < min(full / 4, 8 * chunk_logits), (mem.temp_size_in_bytes, full)
