"""Stage-1 objective: the one-pass layout equals block-by-block inference, leaks are detected, the loss runs."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from support import jitted as J
from support.block_layout import assert_rel_close, block_layout, perturb_params
from dgemma.diffusion import masks as bd_masks
from dgemma.diffusion.stage1 import Stage1Config, one_pass_hidden, one_pass_masks, stage1_loss
from dgemma.model.cache import KVCache
from dgemma.model.config import ExecutionConfig, tiny
from dgemma.model.transformer import Transformer

P, L, N = 6, 8, 3  # prompt, canvas, blocks: context (P + 2L = 22) far beyond the window (4)


def _model(**overrides):
    return perturb_params(Transformer(tiny(tie_layer_scalar=False, **overrides), rngs=nnx.Rngs(0)))


def _layout(B=2, left_pad=(0, 2), unused_last_block=(False, True), seed=0):
    R = N * L
    tokens = np.array(jax.random.randint(jax.random.key(seed), (B, P + R), 3, 120))
    tokens, valid, block_id = block_layout(tokens, P, L, N, left_pad, unused_last_block)
    positions = np.broadcast_to(np.arange(P + R), (B, P + R))
    return {k: jnp.asarray(v) for k, v in dict(tokens=tokens, valid=valid, block_id=block_id,
                                                positions=positions).items()}


# Compiled pieces (eager op-by-op compiles cost minutes); small programs so that the ones no parametrization changes
# (the AR forward, the encoder) are compiled once and read from the compile cache by the others.
@nnx.jit(static_argnames="strict")
def _one_pass_logits(model, batch, x_t, soft, sc_mask, strict=True):
    streams = bd_masks.concat_streams(batch["tokens"], x_t, batch["positions"], batch["valid"], batch["block_id"])
    T = batch["tokens"].shape[1]
    masks = one_pass_masks(model.cfg, streams, strict=strict)
    return model.logits(one_pass_hidden(model, streams, masks, T, soft, sc_mask))


@nnx.jit
def _encoded_cache(model, tokens, valid):
    _, cache = model.encode(tokens, KVCache.init(model.cfg, tokens.shape[0], P + N * L), valid)
    return cache


@nnx.jit
def _decoder_logits(model, canvas, cache, soft, sc_mask):
    return model.logits(model.decode(canvas, cache, soft_embeds=soft, sc_mask=sc_mask))


@pytest.mark.parametrize("decoder_sliding", ["hf_fixed", "jax_per_query"])
@pytest.mark.parametrize("with_sc", [False, True])
def test_one_pass_equals_block_by_block_inference(decoder_sliding, with_sc):
    model = _model(decoder_sliding=decoder_sliding)
    batch = _layout()
    B, T = batch["tokens"].shape
    x_t = jax.random.randint(jax.random.key(5), (B, N * L), 0, model.cfg.vocab_size)
    soft = sc_mask = None
    if with_sc:
        soft = 3.0 * jax.random.normal(jax.random.key(6), (B, N * L, model.cfg.hidden_size))
        sc_mask = jnp.array([True, False])
    logits = _one_pass_logits(model, batch, x_t, soft, sc_mask)
    # the clean stream is exactly the AR model (T10a)
    ar = J.forward(model, batch["tokens"], valid=batch["valid"])
    assert_rel_close(np.where(batch["valid"][..., None], logits[:, :T], 0), np.where(batch["valid"][..., None], ar, 0))
    for b in range(N):
        cache = _encoded_cache(model, batch["tokens"][:, : P + b * L], batch["valid"][:, : P + b * L])
        sl = slice(b * L, (b + 1) * L)
        ref = _decoder_logits(model, x_t[:, sl], cache, None if soft is None else soft[:, sl], sc_mask)
        got = logits[:, T + b * L: T + (b + 1) * L]
        rows = [r for r in range(B) if bool(batch["block_id"][r, P + b * L] >= 0)]  # skip unused canvases
        np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(ref)[rows], atol=5e-5, rtol=0,
                                   err_msg=f"block {b}")


def test_leaky_mask_is_detected():
    """With blk(k) <= blk(q) the canvas sees its own clean answer: the train/inference invariant breaks."""
    model = _model()
    batch = _layout(left_pad=(0, 0), unused_last_block=(False, False))
    B, T = batch["tokens"].shape
    x_t = jax.random.randint(jax.random.key(5), (B, N * L), 0, model.cfg.vocab_size)
    leaky = _one_pass_logits(model, batch, x_t, None, None, strict=False)
    ref = _decoder_logits(model, x_t[:, :L], _encoded_cache(model, batch["tokens"][:, :P], None), None, None)
    assert float(jnp.abs(leaky[:, T:T + L] - ref).max()) > 1e-2


def _data_batch(B=4):
    from dgemma.data.layout import to_layout
    from dgemma.data.config import LayoutConfig

    cc = LayoutConfig(prompt_len=P, canvas_length=L, n_blocks=N)
    rng = np.random.default_rng(0)
    rows = [to_layout(list(rng.integers(3, 30, size=4)), list(rng.integers(3, 30, size=int(n))), cc)
            for n in (3, 9, 17, 12)[:B]]
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


@pytest.mark.parametrize("alignment", ["noshift", "shift"])
def test_stage1_loss_and_grad_finite(alignment):
    model = _model(vocab_size=32)
    batch = _data_batch()
    cfg = Stage1Config(head_alignment=alignment)
    graphdef, state = nnx.split(model)

    def f(state):
        loss, metrics = stage1_loss(nnx.merge(graphdef, state), batch, jax.random.key(0), cfg)
        return loss, metrics

    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(state)
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert float(metrics["loss_ar"]) > 0 and float(metrics["loss_diffusion"]) > 0
    gnorm = sum(float(jnp.sum(g.astype(jnp.float32) ** 2)) for g in jax.tree.leaves(grads))
    assert np.isfinite(gnorm) and gnorm > 0
    # the self-conditioning MLP and the decoder scalar receive gradient (noisy stream), as does the router
    g = nnx.to_flat_state(grads)
    flat = {tuple(p): v for p, v in g}
    assert float(jnp.abs(flat[("self_conditioning", "mlp", "down")][...]).sum()) > 0
    assert float(jnp.abs(flat[("layers", 0, "decoder_layer_scalar")][...]).sum()) > 0


def test_unused_canvas_does_not_change_the_loss():
    model = _model(vocab_size=32)
    batch = _data_batch()
    cfg = Stage1Config(p_self_cond=0.0)
    loss_fn = nnx.jit(lambda m, b: stage1_loss(m, b, jax.random.key(1), cfg)[0])  # one program for both batches
    loss_a = loss_fn(model, batch)
    resp_blk = batch["block_id"][:, P:]
    garbage = jnp.where(resp_blk[:, :] < 0, 17, batch["tokens"][:, P:])  # rewrite tokens of unused canvases only
    batch_b = dict(batch, tokens=batch["tokens"].at[:, P:].set(garbage))
    loss_b = loss_fn(model, batch_b)
    assert bool(jnp.any(garbage != batch["tokens"][:, P:]))
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-6)


def test_nelbo_estimate_is_finite_and_bounds_the_denoising_ce_scale():
    from dgemma.eval.denoise import nelbo_estimate

    model = _model(vocab_size=32)
    est = nelbo_estimate(model, [_data_batch()], jax.random.key(0), samples=2)
    # an upper bound on -log p per token: positive, finite, and above the entropy floor of 0
    assert np.isfinite(est["nelbo"]) and est["nelbo"] > 0 and est["diffusion_term"] >= 0


def test_chunked_soft_embedding_equals_full():
    model = _model()
    hidden = jax.random.normal(jax.random.key(3), (2, 19, model.cfg.hidden_size))
    tau = jnp.array([0.5, 0.8])[:, None, None]
    full = model.soft_embed(model.logits(hidden) / tau)
    chunked = model.embedder.soft_encode_hidden(hidden, model.cfg.final_logit_softcapping, model.dtype,
                                                temperature=tau, chunk=4)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), atol=1e-5, rtol=1e-5)


def test_block_remat_gives_the_same_loss_and_gradients():
    """model.execution.remat=block only changes what the backward pass stores, not the numbers."""
    batch = _data_batch()
    cfg = Stage1Config()
    out = {}
    for remat in ("none", "block"):
        model = _model(vocab_size=32, execution=ExecutionConfig(remat=remat))
        graphdef, state = nnx.split(model)

        def f(state):
            return stage1_loss(nnx.merge(graphdef, state), batch, jax.random.key(0), cfg)[0]

        out[remat] = jax.jit(jax.value_and_grad(f))(state)
    np.testing.assert_allclose(float(out["block"][0]), float(out["none"][0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out["block"][1]), jax.tree.leaves(out["none"][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
