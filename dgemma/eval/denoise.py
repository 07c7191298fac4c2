"""Stage-1 denoising metrics at fixed noise levels: loss by noise level and one-step denoise accuracy.

For each t on a grid, every supervised canvas position is corrupted with alpha_t = 1 - t and the model predicts x0 in
one decoder pass (no self-conditioning: the sampler's first step). Reported per t:
  nll        mean CE over supervised positions (per example, then over examples)
  acc        argmax == x0 over supervised positions                  (one-step denoise accuracy)
  acc_noised argmax == x0 over positions whose token was replaced by a different one (the hard part)
Same one-pass layout as training, so all blocks of a row are evaluated at once, with the run's layout settings
(`Stage1Config.clean_attention` and `head_alignment`: under `shift` the prediction of x0[p] is the anchor / query p-1,
exactly as the training loss scores it). Default: `Stage1Config()` (noshift, causal clean stream).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dgemma.diffusion import masks as bd_masks
from dgemma.diffusion.corruption import corrupt
from dgemma.diffusion.losses import per_example_mean
from dgemma.diffusion.stage1 import _shift_targets_hidden, one_pass_hidden, one_pass_masks
from dgemma.diffusion.stage1_config import Stage1Config

DEFAULT_T_GRID = (0.1, 0.3, 0.5, 0.7, 0.9)


def denoiser_logits(model, batch: dict, x_t, cfg: Stage1Config | None = None) -> jax.Array:
    """[B, R, V] logits of p(x0[p] | x_t) at every response position p, in the layout `cfg` trains with."""
    cfg = cfg or Stage1Config()
    tokens = batch["tokens"]
    T, R = tokens.shape[1], x_t.shape[1]
    streams = bd_masks.concat_streams(tokens, x_t, batch["positions"], batch["valid"], batch["block_id"])
    masks = one_pass_masks(model.cfg, streams, clean_attention=cfg.clean_attention, num_clean=T)
    hidden = one_pass_hidden(model, streams, masks, T)
    h_noisy = hidden[:, T:]
    if cfg.head_alignment == "shift":
        h_noisy = _shift_targets_hidden(hidden[:, :T], h_noisy, T - R, model.cfg.canvas_length)
    return model.logits(h_noisy)


def denoise_at(model, batch: dict, key, t: float, cfg: Stage1Config | None = None) -> dict[str, jax.Array]:
    mc = model.cfg
    tokens = batch["tokens"]
    R = batch["diffusion_weight"].shape[1]
    T = tokens.shape[1]
    x0 = tokens[:, T - R:]
    sup = batch["diffusion_weight"] > 0
    x_t = corrupt(key, x0, 1.0 - t, sup, vocab_size=mc.vocab_size)
    logits = denoiser_logits(model, batch, x_t, cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, x0[..., None], axis=-1)[..., 0]
    ex, has = per_example_mean(nll, sup.astype(jnp.float32))
    correct = (jnp.argmax(logits, -1) == x0)
    noised = sup & (x_t != x0)
    return {
        "nll": jnp.sum(ex) / jnp.maximum(jnp.sum(has), 1),
        "acc": jnp.sum(correct & sup) / jnp.maximum(jnp.sum(sup), 1),
        "acc_noised": jnp.sum(correct & noised) / jnp.maximum(jnp.sum(noised), 1),
    }


def denoise_metrics(model, batches, key, t_grid=DEFAULT_T_GRID,
                    cfg: Stage1Config | None = None) -> dict[float, dict[str, float]]:
    """Average `denoise_at` over batches for each t. Returns {t: {"nll", "acc", "acc_noised"}}."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, b, k, t: denoise_at(nnx.merge(graphdef, st), b, k, t, cfg))
    out = {}
    for i, t in enumerate(t_grid):
        rows = [fn(state, {k: jnp.asarray(v) for k, v in b.items() if k != "index"},
                   jax.random.fold_in(key, i * 1000 + j), jnp.float32(t)) for j, b in enumerate(batches)]
        out[float(t)] = {k: float(np.mean([float(r[k]) for r in rows])) for k in rows[0]}
    return out


def nelbo_at(model, batch: dict, key, t_min: float = 1e-3, t_max: float = 1.0 - 1e-3,
             cfg: Stage1Config | None = None) -> dict[str, jax.Array]:
    """One Monte-Carlo sample of the exact uniform-noise NELBO per supervised token (nats), docs/stage1.md §3.

    t ~ U(t_min, t_max) per (example, block) (stratified); the integrand uses the LOO-converted logits of the
    CE-trained denoiser in the fp32-safe folded form. NELBO/token ~= (t_max - t_min) E_t[l_t] + L_prior(alpha(t_max))
    + L_recon, with L_recon = -log p(x0 | x_{t_min}) estimated from the same forward pass at t_min.
    """
    from dgemma.diffusion.elbo import nelbo_integrand, prior_loss
    from dgemma.diffusion.schedule import expand_per_block, sample_t

    mc = model.cfg
    tokens = batch["tokens"]
    R = batch["diffusion_weight"].shape[1]
    T = tokens.shape[1]
    L = mc.canvas_length
    x0 = tokens[:, T - R:]
    sup = batch["diffusion_weight"] > 0
    blk = batch["block_id"][:, T - R:]
    k_t, k_n, k_r = jax.random.split(key, 3)
    t = sample_t(k_t, tokens.shape[0], R // L, t_min, t_max, antithetic=True)
    alpha = expand_per_block(1.0 - t, blk, fill=1.0)

    def noisy_logits(x_t):
        return denoiser_logits(model, batch, x_t, cfg)

    x_t = corrupt(k_n, x0, alpha, sup, vocab_size=mc.vocab_size)
    ell = nelbo_integrand(noisy_logits(x_t), x0, x_t, alpha, -jnp.ones_like(alpha), vocab_size=mc.vocab_size)
    x_rec = corrupt(k_r, x0, 1.0 - t_min, sup, vocab_size=mc.vocab_size)
    recon = -jnp.take_along_axis(jax.nn.log_softmax(noisy_logits(x_rec), -1), x0[..., None], -1)[..., 0]
    w = sup.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w), 1.0)
    diffusion = (t_max - t_min) * jnp.sum(ell * w) / n
    return {"nelbo": diffusion + prior_loss(1.0 - t_max, mc.vocab_size) + jnp.sum(recon * w) / n,
            "diffusion_term": diffusion}


def nelbo_estimate(model, batches, key, samples: int = 4, cfg: Stage1Config | None = None) -> dict[str, float]:
    """Average of `nelbo_at` over batches x `samples` draws of t and noise (nats per supervised token)."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, b, k: nelbo_at(nnx.merge(graphdef, st), b, k, cfg=cfg))
    rows = [fn(state, {k: jnp.asarray(v) for k, v in b.items() if k != "index"}, jax.random.fold_in(key, i))
            for i in range(samples) for b in batches]
    return {k: float(np.mean([float(r[k]) for r in rows])) for k in rows[0]}
