"""Bridge posterior q(z_s | z_t, x), denoiser ↔ leave-one-out logits, and the exact ancestral step.

Bridge posterior (eq. 1.3)
--------------------------
For s < t, α_{t|s} = α_t/α_s, an observed noisy token z_t = z and a (one-hot or soft) clean distribution x ∈ Δ^V:

    q(z_s | z_t, x) = [ α_t V x ⊙ e_z + (α_{t|s} − α_t) e_z + (α_s − α_t) x + (1 − α_{t|s})(1 − α_s)/V · 1 ]
                      / [ α_t V x_z + 1 − α_t ]

(UDLM ``_compute_posterior``, DUO ``_posterior_from_x0``). For one-hot x this is Bayes' rule
q(z_t | z_s) q(z_s | x0) / q(z_t | x0). It is **nonlinear** in x because the denominator reads x_z.

Denoiser vs leave-one-out (eqs. 1.4–1.5)
----------------------------------------
A CE-trained network estimates the *denoiser* p(x0^j | x_t). Its own noisy token z = x_t^j is evidence for x0^j = z
with likelihood ratio 1 + r_t, r_t = Vα_t/(1 − α_t), so

    logits_denoiser = logits_LOO + Δ_t · onehot(z),      Δ_t = log(1 + V α_t/(1 − α_t)) = log1p(r_t).

The leave-one-out (LOO) posterior p⁻ predicts x0^j from everything *except* z. The exact reverse kernel of a denoiser
p is the mixture Σ_v p(v) q(z_s | z_t, e_v) = q(z_s | z_t, LOO(p)) — NOT q(z_s | z_t, p). Hence:

* "sample x̂0 ~ p, then z_s ~ q(z_s | z_t, e_x̂0)" (:func:`ancestral_step`) is exact and needs no conversion;
* plugging a distribution into (1.3) or into the UDLM ELBO requires LOO(p) (:func:`denoiser_to_loo_logits`).

Three-way ancestral step (docs/sampler.md §5)
---------------------------------------------
With one-hot x̂0 = e_v, (1.3) collapses to three outcomes; with c = (1 − α_{t|s})(1 − α_s)/V (so V c is the total
uniform mass):

    v == z:  with prob. V c / (α_t V + 1 − α_t) draw u ~ Unif(V), else keep z.
    v != z:  with prob. V c / (1 − α_t)         draw u ~ Unif(V), else pick
             z with prob. (α_{t|s} − α_t)/(α_s + α_{t|s} − 2α_t) and v with prob. (α_s − α_t)/(α_s + α_{t|s} − 2α_t).

No V-vector is materialized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "bridge_posterior",
    "loo_delta",
    "denoiser_to_loo_logits",
    "loo_to_denoiser_logits",
    "ancestral_step_probs",
    "ancestral_step",
    "ancestral_step_from_logits",
]

_TINY = 1e-30


def _onehot_mask(z: jax.Array, vocab_size: int) -> jax.Array:
    """Boolean [..., V] with True at index z (an iota compare; XLA fuses it, no one-hot float array)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, z.shape + (vocab_size,), z.ndim)
    return iota == z[..., None].astype(jnp.int32)


def bridge_posterior(x: jax.Array, z_t: jax.Array, alpha_t: jax.Array, alpha_s: jax.Array) -> jax.Array:
    """q(z_s | z_t, x) of eq. (1.3) for a soft or one-hot clean distribution x.

    Args:
      x: [..., V] probabilities over the clean token (rows sum to 1).
      z_t: [...] int observed noisy tokens.
      alpha_t: α_t, broadcastable to z_t's shape.
      alpha_s: α_s ≥ α_t (s < t), broadcastable to z_t's shape.

    Returns:
      [..., V] distribution over z_s, in x's dtype. (Reference-size helper: materializes V-vectors.)
    """
    vocab = x.shape[-1]
    a_t = jnp.asarray(alpha_t, x.dtype)[..., None]
    a_s = jnp.asarray(alpha_s, x.dtype)[..., None]
    a_ts = a_t / jnp.maximum(a_s, _TINY)
    e_z = _onehot_mask(z_t, vocab).astype(x.dtype)
    x_z = jnp.take_along_axis(x, z_t[..., None].astype(jnp.int32), axis=-1)
    c = (1.0 - a_ts) * (1.0 - a_s) / vocab
    num = a_t * vocab * x * e_z + (a_ts - a_t) * e_z + (a_s - a_t) * x + c
    den = a_t * vocab * x_z + 1.0 - a_t
    return num / den


def loo_delta(alpha_t: jax.Array, vocab_size: int) -> jax.Array:
    """Δ_t = log(1 + V α_t/(1 − α_t)), the logit bonus the denoiser gives its own noisy token.

    Infinite at α_t = 1 (t = 0: a token that is certainly clean); sample t ≥ t_min > 0.
    """
    a = jnp.asarray(alpha_t)
    return jnp.log1p(vocab_size * a / (1.0 - a))


def denoiser_to_loo_logits(
    logits: jax.Array, x_t: jax.Array, alpha_t: jax.Array, vocab_size: int | None = None
) -> jax.Array:
    """logits_LOO = logits_denoiser − Δ_t · onehot(x_t)  (eq. 1.5).

    Args:
      logits: [..., V'] denoiser logits (V' ≥ V allowed if the head is padded; padded ids must never be x_t).
      x_t: [...] int noisy tokens at the same positions.
      alpha_t: α_t, broadcastable to x_t's shape (per token, per row or scalar).
      vocab_size: V of the forward process (the noise vocabulary). Defaults to ``logits.shape[-1]``.

    Returns:
      [..., V'] logits (same dtype) whose softmax is the leave-one-out posterior LOO(p).
    """
    return _shift_at(logits, x_t, -loo_delta(alpha_t, vocab_size or logits.shape[-1]))


def loo_to_denoiser_logits(
    logits: jax.Array, x_t: jax.Array, alpha_t: jax.Array, vocab_size: int | None = None
) -> jax.Array:
    """Inverse of :func:`denoiser_to_loo_logits`: logits_denoiser = logits_LOO + Δ_t · onehot(x_t)."""
    return _shift_at(logits, x_t, loo_delta(alpha_t, vocab_size or logits.shape[-1]))


def _shift_at(logits: jax.Array, idx: jax.Array, amount: jax.Array) -> jax.Array:
    dtype = jnp.promote_types(logits.dtype, jnp.float32)  # shift in >= fp32, store back in the logits dtype
    amount = jnp.broadcast_to(jnp.asarray(amount, dtype), idx.shape)
    hit = _onehot_mask(idx, logits.shape[-1])
    shifted = logits.astype(dtype) + amount[..., None]
    return jnp.where(hit, shifted.astype(logits.dtype), logits)


def ancestral_step_probs(
    z_t: jax.Array, x0_hat: jax.Array, alpha_t: jax.Array, alpha_s: jax.Array, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
    """Probabilities of the three-way ancestral step (docs/sampler.md §5).

    Args:
      z_t: [...] int current noisy tokens.
      x0_hat: [...] int sampled (or argmax) clean tokens.
      alpha_t, alpha_s: signal levels (α_s ≥ α_t), broadcastable to z_t.
      vocab_size: V.

    Returns:
      (p_uniform, p_keep_z): p_uniform = P(z_s is a fresh uniform draw); p_keep_z = P(z_s = z_t | not uniform)
      (1 when x0_hat == z_t; otherwise the z-vs-v split). Float32 (or wider if α is), shape of z_t.
    """
    dtype = jnp.result_type(alpha_t, alpha_s, jnp.float32)
    a_t = jnp.asarray(alpha_t, dtype)
    a_s = jnp.asarray(alpha_s, dtype)
    a_ts = a_t / jnp.maximum(a_s, _TINY)
    vc = (1.0 - a_ts) * (1.0 - a_s)  # V·c: total uniform mass (numerator)
    same = x0_hat == z_t
    p_unif = jnp.where(
        same,
        vc / (a_t * vocab_size + 1.0 - a_t),
        vc / jnp.maximum(1.0 - a_t, _TINY),
    )
    split_den = a_s + a_ts - 2.0 * a_t
    p_keep = jnp.where(same, 1.0, (a_ts - a_t) / jnp.maximum(split_den, _TINY))
    return p_unif, p_keep


def ancestral_step(
    key: jax.Array,
    z_t: jax.Array,
    x0_hat: jax.Array,
    alpha_t: jax.Array,
    alpha_s: jax.Array,
    vocab_size: int,
) -> jax.Array:
    """Draw z_s ~ q(z_s | z_t, e_{x̂0}) with the three-way choice (no V-vectors).

    Args:
      key: PRNG key.
      z_t: [...] int current canvas.
      x0_hat: [...] int a draw x̂0 ~ p_θ(· | z_t) (τ = 1 makes the step exact) or its argmax (greedy).
      alpha_t, alpha_s: α at the current time t and at the next, smaller time s (α_s ≥ α_t); broadcastable.
      vocab_size: V.

    Returns:
      z_s, same shape/dtype as z_t. At α_s = 1 (s = 0) this returns x̂0.
    """
    p_unif, p_keep = ancestral_step_probs(z_t, x0_hat, alpha_t, alpha_s, vocab_size)
    k_u, k_c, k_r = jax.random.split(key, 3)
    u_unif = jax.random.uniform(k_u, z_t.shape, dtype=jnp.float32)
    u_choice = jax.random.uniform(k_c, z_t.shape, dtype=jnp.float32)
    r = jax.random.randint(k_r, z_t.shape, 0, vocab_size, dtype=jnp.int32).astype(z_t.dtype)
    kept = jnp.where(u_choice < p_keep, z_t, x0_hat.astype(z_t.dtype))
    return jnp.where(u_unif < p_unif, r, kept)


def ancestral_step_from_logits(key: jax.Array, logits: jax.Array, z_t: jax.Array, alpha_t: jax.Array,
                               alpha_s: jax.Array, *, vocab_size: int | None = None, temperature: float = 1.0,
                               greedy: bool = False) -> tuple[jax.Array, jax.Array]:
    """Exact ancestral step from *denoiser* logits: x̂0 ~ softmax(logits/τ) (or argmax), then :func:`ancestral_step`.

    Returns:
      (z_s, x0_hat). No LOO conversion is needed (see module docstring).
    """
    vocab = vocab_size or logits.shape[-1]
    k_x, k_step = jax.random.split(key)
    if greedy:
        x0_hat = jnp.argmax(logits, axis=-1)
    else:
        x0_hat = jax.random.categorical(k_x, logits.astype(jnp.float32) / temperature, axis=-1)
    x0_hat = x0_hat.astype(z_t.dtype)
    return ancestral_step(k_step, z_t, x0_hat, alpha_t, alpha_s, vocab), x0_hat
