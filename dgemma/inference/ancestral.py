"""Exact ancestral sampler step for one block (docs/sampler.md §5): the reference / teacher option.

Time grid linear in t: 1 = t_0 > t_1 > … > t_K = 0, t_n = 1 − n/K (K = K_max = `max_steps`), with the signal level
of the training schedule (default linear, α_t = 1 − t). Step n (0-based):

    1. logits ← decoder(canvas, cache, SC);  z = logits / τ  (τ = 1 is exact)
    2. x̂0 ~ softmax(z)   (or argmax, `greedy`)
    3. canvas ← z_s ~ q(z_s | z_t = canvas, e_x̂0) with t = t_n, s = t_{n+1}   (three-way step, no V-vectors)
    4. SC ← z

At the last step α_s = α_0 = 1, so the bridge returns x̂0 itself: the block's output is the final canvas (= x̂0 of the
last step). Because a CE-trained network is a *denoiser*, "sample x̂0, then bridge with one-hot x̂0" is the exact
reverse kernel; no leave-one-out conversion is needed (`dgemma.diffusion.posterior`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dgemma.diffusion.posterior import ancestral_step_from_logits
from dgemma.diffusion.schedule import ScheduleName, get_schedule

__all__ = ["time_grid_alphas", "ancestral_block_step"]


def time_grid_alphas(step_index, max_steps: int, schedule: ScheduleName = "linear") -> tuple[jax.Array, jax.Array]:
    """(α_t, α_s) for loop iteration `step_index` on the linear time grid t_n = 1 − n/K_max."""
    sched = get_schedule(schedule)
    n = jnp.asarray(step_index, jnp.float32)
    t = 1.0 - n / max_steps
    s = 1.0 - (n + 1.0) / max_steps
    return sched.alpha(t), jnp.where(n + 1 >= max_steps, 1.0, sched.alpha(jnp.maximum(s, 0.0)))


def ancestral_block_step(keys: jax.Array, logits: jax.Array, canvas: jax.Array, step_index, max_steps: int, *,
                         temperature=1.0, greedy: bool = False, schedule: ScheduleName = "linear"):
    """One ancestral step for every row with its own key.

    Args:
      keys: [B] per-row PRNG keys for this step.
      logits: [B, L, V] fp32 denoiser logits (untempered).
      canvas: [B, L] int32 current canvas z_t.
      step_index: 0-based loop iteration n (traced is fine).
      max_steps: K_max, the number of steps of the grid.
      temperature: τ for x̂0 ~ softmax(logits/τ) (traced is fine); 1.0 is the exact sampler.
      greedy: x̂0 = argmax instead of a draw.

    Returns:
      (new canvas z_s [B, L] int32, x̂0 [B, L] int32).
    """
    alpha_t, alpha_s = time_grid_alphas(step_index, max_steps, schedule)
    vocab = logits.shape[-1]

    def one_row(key, row_logits, row_canvas):
        z_s, x0 = ancestral_step_from_logits(key, row_logits, row_canvas, alpha_t, alpha_s, vocab_size=vocab,
                                             temperature=temperature, greedy=greedy)
        return z_s, x0

    z_s, x0 = jax.vmap(one_row)(keys, logits, canvas)
    return z_s.astype(jnp.int32), x0.astype(jnp.int32)
