"""Stage-1 loss weighting (docs/stage1.md §3) and the `shift` alignment's self-conditioning input."""

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.diffusion import masks as bd_masks
from dgemma.diffusion.stage1 import (
    Stage1Config,
    _shift_targets_hidden,
    one_pass_hidden,
    one_pass_masks,
    self_conditioning_hidden,
    stage1_loss,
)
from test_stage1 import L, N, P, _data_batch, _model


def test_reweighted_multiplies_each_examples_mean_nll(selection="one_random"):
    """`reweighted` is w(t) x mean NLL: with the same t and noise, the diffusion loss is Σ_e Σ_b w(t_eb) n_eb nll_eb /
    Σ_b n_eb averaged over examples. (A w(t) inside Σw·nll/Σw cancelled: `one_random` gave exactly the base loss.)"""
    model = _model(vocab_size=32)
    batch = _data_batch()
    base = Stage1Config(p_self_cond=0.0, block_selection=selection)
    rew = dataclasses.replace(base, loss_weighting="reweighted", reweight_max=10.0)
    key = jax.random.key(4)
    _, mb = nnx.jit(lambda m: stage1_loss(m, batch, key, base))(model)  # one program each, not eager op-by-op
    _, mr = nnx.jit(lambda m: stage1_loss(m, batch, key, rew))(model)
    t, nll, has = (np.asarray(mb[k], np.float64) for k in ("block_t", "block_nll", "block_has"))
    # supervised tokens per (example, block): recount from the layout the loss saw
    n_sup = np.asarray(batch["diffusion_weight"], np.float64).reshape(-1, N, L).sum(-1) * has
    w = np.minimum(1.0 / (1.0 - t), 10.0)
    per_ex_base = (n_sup * nll).sum(1) / np.maximum(n_sup.sum(1), 1)
    per_ex_rew = (n_sup * w * nll).sum(1) / np.maximum(n_sup.sum(1), 1)
    rows = n_sup.sum(1) > 0
    np.testing.assert_allclose(float(mb["loss_diffusion"]), per_ex_base[rows].mean(), rtol=1e-5)
    np.testing.assert_allclose(float(mr["loss_diffusion"]), per_ex_rew[rows].mean(), rtol=1e-5)
    assert float(mr["loss_diffusion"]) > 1.05 * float(mb["loss_diffusion"])  # w(t) > 1 for every t > 0


def test_shift_self_conditioning_input_is_the_prediction_of_its_own_position():
    """Under `shift`, query p predicts x0[p+1]; the SC input at p must be the prediction OF x0[p] (what the loss
    scores against x0[p]), i.e. the shifted rows, as under `noshift`."""
    model = _model(vocab_size=32)
    batch = _data_batch()
    tokens = batch["tokens"]
    T = tokens.shape[1]
    x_t = jax.random.randint(jax.random.key(2), (tokens.shape[0], N * L), 0, 32)
    streams = bd_masks.concat_streams(tokens, x_t, batch["positions"], batch["valid"], batch["block_id"])
    first = nnx.jit(lambda m: one_pass_hidden(m, streams, one_pass_masks(m.cfg, streams), T))(model)
    scored = _shift_targets_hidden(first[:, :T], first[:, T:], P, L)  # the rows the loss scores against x0
    np.testing.assert_array_equal(np.asarray(self_conditioning_hidden(first, T, P, L, "shift")), np.asarray(scored))
    np.testing.assert_array_equal(np.asarray(self_conditioning_hidden(first, T, P, L, "noshift")),
                                  np.asarray(first[:, T:]))
    assert not np.allclose(np.asarray(scored), np.asarray(first[:, T:]))


@pytest.mark.parametrize(("alignment", "clean_attention"), [("shift", "causal"), ("noshift", "block_causal")])
def test_eval_denoiser_scores_what_training_scores(alignment, clean_attention):
    """`dgemma.eval.denoise` evaluates in the run's layout: its NLL at the training noise equals the loss's per-block
    NLL (it used to hard-code noshift + causal, so shift-trained models were scored off by one)."""
    from dgemma.diffusion.stage1 import noise_batch
    from dgemma.eval.denoise import denoiser_logits

    model = _model(vocab_size=32)
    batch = _data_batch()
    cfg = Stage1Config(p_self_cond=0.0, head_alignment=alignment, clean_attention=clean_attention)
    key = jax.random.key(6)
    _, metrics = nnx.jit(lambda m: stage1_loss(m, batch, key, cfg))(model)
    _, x_t, weights = noise_batch(jax.random.split(key)[0], batch, cfg, 32, N)
    logp = jax.nn.log_softmax(nnx.jit(lambda m: denoiser_logits(m, batch, x_t, cfg))(model).astype(jnp.float32), -1)
    nll = -jnp.take_along_axis(logp, batch["tokens"][:, P:, None], -1)[..., 0]
    sup = np.asarray(weights > 0, np.float64).reshape(-1, N, L)
    block = (np.asarray(nll, np.float64).reshape(-1, N, L) * sup).sum(-1) / np.maximum(sup.sum(-1), 1)
    np.testing.assert_allclose(block, np.asarray(metrics["block_nll"]), rtol=1e-4, atol=1e-5)
