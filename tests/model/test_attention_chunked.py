"""model.execution.attention_impl=chunked: the structured masks equal the dense ones, and the flash path equals the
dense path in forward and gradients (fp32, <= 1e-5) for the one-pass stage-1 layout, the encoder with cache and the
decoder over the cache; the chunked path never builds a [T, T]-shaped intermediate."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from support import jitted as J
from support.block_layout import max_rel, perturb_params, stage1_batch
from dgemma.diffusion import masks as bd_masks
from dgemma.diffusion.stage1 import Stage1Config, one_pass_masks, stage1_loss
from dgemma.model import masks as mask_lib
from dgemma.model.attention_chunked import chunked_attention
from dgemma.model.attention_mask import IntervalMask, interval_mask
from dgemma.model.cache import KVCache
from dgemma.model.config import FULL, SLIDING, tiny
from dgemma.model.transformer import Transformer

P, L, N = 6, 8, 3  # prompt, canvas, blocks: context far beyond the window (4); streams T = 6 + 2 * 24 = 54
TOL = 1e-5


def _model(impl="dense", q_chunk=18, **overrides):
    cfg = tiny(**{**dict(tie_layer_scalar=False), **overrides}).with_execution(
        attention_impl=impl, attention_q_chunk=q_chunk, attention_kv_chunk=9)
    return perturb_params(Transformer(cfg, rngs=nnx.Rngs(0)))


def _twin(model, impl):
    """The same weights under another attention implementation."""
    twin = Transformer(model.cfg.with_execution(attention_impl=impl), rngs=nnx.Rngs(0))
    nnx.update(twin, nnx.state(model))
    return twin


def _batch(left_pad=(0, 2, 5), unused_last_block=(False, True, False), seed=0):
    return stage1_batch(P, L, N, left_pad, unused_last_block, seed)


def _norm_rel(a, b):
    """||a - b|| / ||b|| (gradients: summation-order noise of fp32 accumulations over many tokens)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(1e-12, np.linalg.norm(b)))


# MARK: masks ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decoder_sliding", ["hf_fixed", "jax_per_query"])
@pytest.mark.parametrize("clean_attention", ["causal", "block_causal"])
def test_one_pass_intervals_equal_dense_mask(decoder_sliding, clean_attention):
    batch = _batch()
    x_t = jnp.zeros((3, N * L), jnp.int32)
    streams = bd_masks.concat_streams(batch["tokens"], x_t, batch["positions"], batch["valid"], batch["block_id"])
    for layer, window in ((SLIDING, 4), (FULL, None)):
        kw = dict(window=window, layer_type=layer, decoder_sliding=decoder_sliding, clean_attention=clean_attention)
        dense = bd_masks.block_diffusion_mask(streams.info, streams.info, **kw)
        structured = bd_masks.block_diffusion_intervals(streams.info, **kw)
        np.testing.assert_array_equal(structured.to_dense(), dense)
        assert dense[:, P + N * L:].any()  # noisy rows are non-trivial


@pytest.mark.parametrize("decoder_sliding", ["hf_fixed", "jax_per_query"])
def test_cache_intervals_equal_dense_masks_over_a_ring(decoder_sliding):
    dense_m, chunked_m = _model(decoder_sliding=decoder_sliding), None
    cfg_c = dense_m.cfg.with_execution(attention_impl="chunked")
    cache = KVCache.init(dense_m.cfg, 2, 40)
    assert cache.keys[0].shape[1] == 4 - 1 + L < 40 and cache.keys[2].shape[1] == 40  # a ring on sliding layers
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 3, 120)
    valid = jnp.ones((2, 17), bool).at[1, :3].set(False)
    _, cache = dense_m.encode(tokens, cache, valid)
    pos = cache.length + jnp.broadcast_to(jnp.arange(5)[None], (2, 5))
    for build, args in ((mask_lib.encoder_masks, (pos, jnp.ones((2, 5), bool))),
                        (mask_lib.decoder_masks, (pos, jnp.ones((2, 5), bool).at[0, 4].set(False)))):
        dense, structured = build(dense_m.cfg, cache, *args), build(cfg_c, cache, *args)
        for t in (SLIDING, FULL):
            assert isinstance(structured[t], IntervalMask)
            np.testing.assert_array_equal(structured[t].to_dense(), dense[t])
    del chunked_m


# MARK: kernel -----------------------------------------------------------------------------------------------------


def _dense_attention(q, k, v, allowed):
    s = jnp.einsum("btkgd,bskd->bkgts", q, k)
    s = jnp.where(allowed[:, None, None], s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize("q_chunk,kv_chunk", [(4, 4), (5, 7), (64, 64)])
def test_kernel_equals_dense_with_two_intervals_and_padding(q_chunk, kv_chunk):
    B, T, KV, G, D = 2, 24, 2, 2, 8
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, KV, G, D))
    k, v = (jax.random.normal(x, (B, T, KV, D)) for x in ks[1:])
    pos = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    valid = jnp.ones((B, T), bool).at[1, :3].set(False)
    # causal window of 5 plus a bidirectional second interval [16, 20) for queries 16..19
    second = (pos >= 16) & (pos < 20)
    m = interval_mask(pos, valid, pos - 4, pos + 1, jnp.where(second, 16, 0), jnp.where(second, 20, 0))
    allowed = m.to_dense()
    rows = allowed.any(-1)[:, :, None, None, None].astype(jnp.float32)
    w = jax.random.normal(jax.random.key(3), q.shape)
    f = lambda q, k, v: jnp.sum(chunked_attention(q, k, v, m, q_chunk=q_chunk, kv_chunk=kv_chunk) * rows * w)  # noqa
    g = lambda q, k, v: jnp.sum(_dense_attention(q, k, v, allowed) * rows * w)  # noqa: E731
    assert max_rel(jax.jit(f)(q, k, v), jax.jit(g)(q, k, v)) <= TOL
    out_c = jax.jit(lambda q, k, v: chunked_attention(q, k, v, m, q_chunk=q_chunk, kv_chunk=kv_chunk))(q, k, v)
    assert max_rel(out_c * rows, _dense_attention(q, k, v, allowed) * rows) <= TOL
    for a, b in zip(jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v), jax.jit(jax.grad(g, (0, 1, 2)))(q, k, v)):
        assert max_rel(a, b) <= TOL


# MARK: model ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decoder_sliding", ["hf_fixed", pytest.param("jax_per_query", marks=pytest.mark.slow)])
def test_stage1_loss_and_grads_chunked_equal_dense(decoder_sliding):
    """One-pass layout: sliding + full layers, context > W, left padding, an unused block, self-conditioning."""
    dense = _model(decoder_sliding=decoder_sliding)
    chunked = _twin(dense, "chunked")
    batch = _batch()
    cfg = Stage1Config(p_self_cond=0.5)  # rows with and without the self-conditioning pass

    def loss_and_grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def f(p):
            loss, metrics = stage1_loss(nnx.merge(graphdef, p, rest), batch, jax.random.key(4), cfg)
            return loss, metrics["block_nll"]

        return jax.value_and_grad(f, has_aux=True)(params)

    (l_d, nll_d), g_d = loss_and_grads(dense)
    (l_c, nll_c), g_c = loss_and_grads(chunked)
    assert max_rel(l_c, l_d) <= TOL and float(l_d) > 1.0
    assert max_rel(nll_c, nll_d) <= TOL
    for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_d)):
        assert max_rel(a, b) <= TOL
    assert float(max(jnp.abs(x).max() for x in jax.tree.leaves(g_d))) > 1e-3  # non-trivial gradients


def _over_cache_inputs():
    prompt = jax.random.randint(jax.random.key(2), (2, 13), 3, 120)
    prompt_valid = jnp.ones((2, 13), bool).at[1, :4].set(False)
    canvas = jax.random.randint(jax.random.key(3), (2, L), 0, 120)
    sc = 2.0 * jax.random.normal(jax.random.key(4), (2, L, 128))
    return prompt, prompt_valid, canvas, sc


def test_encoder_and_decoder_over_the_cache_chunked_equal_dense():
    dense = _model()
    chunked = _twin(dense, "chunked")
    prompt, prompt_valid, canvas, sc = _over_cache_inputs()

    def run(model):  # jitted call by call: each program is compiled once and shared by the two implementations' twins
        cache = KVCache.init(model.cfg, 2, 13 + 2 * L)
        h_enc, cache = J.encode(model, prompt, cache, prompt_valid)
        l1 = J.logits(model, J.decode(model, canvas, cache))
        _, cache = J.encode(model, canvas, cache)  # commit, then the next block reads a wrapped ring
        l2 = J.logits(model, J.decode(model, canvas[:, ::-1], cache, sc_logits=sc, sc_mask=jnp.array([True, False])))
        return h_enc, l1, l2, cache

    out_d, out_c = run(dense), run(chunked)
    assert max_rel(out_c[0][0], out_d[0][0]) <= TOL and max_rel(out_c[0][1, 4:], out_d[0][1, 4:]) <= TOL
    for a, b in zip(out_c[1:3], out_d[1:3]):
        assert max_rel(a, b) <= TOL
    for a, b in zip(out_c[3].keys, out_d[3].keys):  # the cache written by the chunked encoder (valid rows)
        assert max_rel(a[0], b[0]) <= TOL


def test_decoder_over_the_cache_gradients_chunked_equal_dense():
    """Parameter gradients of the decoder over a cache. The two implementations sum in different orders (online
    softmax over KV chunks vs one softmax), and through the tiny model's randomized norms and MoE that fp32 noise
    reaches 3-4e-5 of the largest gradient on some tensors (it varies with the CPU, XLA version and flags; measured
    here: norm-relative 5.7e-6, max-relative 4.0e-5), so the bounds keep a 4-5x margin: 3e-5 norm-relative over the
    whole gradient (as for the scanned stack) and 1.5e-4 max-relative per tensor. A wrong mask gives O(1e-1)."""
    dense = _model()
    chunked = _twin(dense, "chunked")
    prompt, prompt_valid, canvas, sc = _over_cache_inputs()
    w = jax.random.normal(jax.random.key(5), (2, L, 128))

    def decoder_grads(model):
        cache = KVCache.init(model.cfg, 2, 13 + L)
        _, cache = J.encode(model, prompt, cache, prompt_valid)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        f = lambda p: jnp.sum(nnx.merge(graphdef, p, rest).logits(  # noqa: E731
            nnx.merge(graphdef, p, rest).decode(canvas, cache, sc_logits=sc)) * w)
        return jax.tree.leaves(jax.jit(jax.grad(f))(params))

    g_c, g_d = decoder_grads(chunked), decoder_grads(dense)
    flat = lambda gs: np.concatenate([np.asarray(g, np.float64).ravel() for g in gs])  # noqa: E731
    assert _norm_rel(flat(g_c), flat(g_d)) <= 3 * TOL
    for a, b in zip(g_c, g_d):
        assert max_rel(a, b) <= 15 * TOL
    assert float(max(np.abs(g).max() for g in g_d)) > 1e-3  # non-trivial gradients


def _shapes(jaxpr, out):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            out.add(tuple(getattr(var.aval, "shape", ())))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    _shapes(inner if hasattr(inner, "eqns") else inner.jaxpr, out)
    return out


def test_chunked_never_builds_a_TxT_intermediate():
    """Every intermediate of the stage-1 loss and its gradient: no shape has the streams length T twice."""
    batch = _batch(left_pad=(2,), unused_last_block=(False,))
    T = P + 2 * N * L
    cfg = Stage1Config(p_self_cond=0.5)
    found = {}
    for impl in ("dense", "chunked"):
        model = _model(impl)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        f = lambda p: stage1_loss(nnx.merge(graphdef, p, rest), batch, jax.random.key(0), cfg)[0]  # noqa: E731
        shapes = _shapes(jax.make_jaxpr(jax.grad(f))(params).jaxpr, set())
        found[impl] = [s for s in shapes if sum(d == T for d in s) >= 2]
    assert found["dense"]  # the check can fail: the dense path has [.., T, T] scores and masks
    assert not found["chunked"], found["chunked"]


def test_chunk_that_does_not_divide_the_layout_is_refused():
    model = _model(q_chunk=16)  # 54 streams: 16 does not divide
    batch = _batch()
    streams = bd_masks.concat_streams(batch["tokens"], jnp.zeros((3, N * L), jnp.int32), batch["positions"],
                                      batch["valid"], batch["block_id"])
    with pytest.raises(ValueError, match="model.execution.attention_q_chunk=16 does not divide"):
        one_pass_masks(model.cfg.with_execution(attention_impl="chunked"), streams)
    with pytest.raises(ValueError, match="ExecutionConfig.attention_impl"):
        tiny().with_execution(attention_impl="flash")
