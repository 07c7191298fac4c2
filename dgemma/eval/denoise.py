"""Stage-1 denoising metrics at fixed noise levels: loss by noise level and one-step denoise accuracy.

For each t on a grid, every supervised canvas position is corrupted with alpha_t = 1 - t and the model predicts x0 in
one decoder pass (no self-conditioning: the sampler's first step). Reported per t:
  nll        mean CE over supervised positions (per example, then over examples)
  acc        argmax == x0 over supervised positions                  (one-step denoise accuracy)
  acc_noised argmax == x0 over positions whose token was replaced by a different one (the hard part)
Same one-pass layout as training, so all blocks of a row are evaluated at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dgemma.diffusion import masks as bd_masks
from dgemma.diffusion.corruption import corrupt
from dgemma.diffusion.losses import per_example_mean
from dgemma.diffusion.stage1 import one_pass_hidden, one_pass_masks

DEFAULT_T_GRID = (0.1, 0.3, 0.5, 0.7, 0.9)


def denoise_at(model, batch: dict, key, t: float) -> dict[str, jax.Array]:
    mc = model.cfg
    tokens = batch["tokens"]
    R = batch["diffusion_weight"].shape[1]
    T = tokens.shape[1]
    x0 = tokens[:, T - R:]
    sup = batch["diffusion_weight"] > 0
    x_t = corrupt(key, x0, 1.0 - t, sup, vocab_size=mc.vocab_size)
    streams = bd_masks.concat_streams(tokens, x_t, batch["positions"], batch["valid"], batch["block_id"])
    hidden = one_pass_hidden(model, streams, one_pass_masks(mc, streams), T)
    logits = model.logits(hidden[:, T:])
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


def denoise_metrics(model, batches, key, t_grid=DEFAULT_T_GRID) -> dict[float, dict[str, float]]:
    """Average `denoise_at` over batches for each t. Returns {t: {"nll", "acc", "acc_noised"}}."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, b, k, t: denoise_at(nnx.merge(graphdef, st), b, k, t))
    out = {}
    for i, t in enumerate(t_grid):
        rows = [fn(state, {k: jnp.asarray(v) for k, v in b.items() if k != "index"},
                   jax.random.fold_in(key, i * 1000 + j), jnp.float32(t)) for j, b in enumerate(batches)]
        out[float(t)] = {k: float(np.mean([float(r[k]) for r in rows])) for k in rows[0]}
    return out
