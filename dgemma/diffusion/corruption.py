"""Uniform-noise forward process q(x_t | x0) (D3PM-uniform / multinomial diffusion).

Concept
-------
Per supervised canvas token j, independently,

    q(x_t^j | x0^j) = α_t · δ(x_t^j = x0^j) + (1 − α_t)/V.                                  (1.1)

Sampling: draw ``move ~ Bernoulli(1 − α_t)`` and ``r ~ Unif{0 … V−1}``; set x_t = r if move else x0. The replacement is
drawn from **all** V ids, so it may equal x0 (P(x_t = x0) = α_t + (1 − α_t)/V) and it may be an id that never occurs in
data; the model has to learn to recognize such noise. There is no [MASK] token.

Only positions in ``corrupt_mask`` are noised. The prompt, clean/committed context and padding pass through unchanged.

Coupled noise for s < t
-----------------------
Draw ONE uniform u_j and ONE replacement r_j per position and threshold u_j at two levels:

    x_t^j = r_j if u_j < 1 − α_t else x0^j,      x_s^j = r_j if u_j < 1 − α_s else x0^j.

Because α_s ≥ α_t, corrupted(s) ⊆ corrupted(t) and both use the same replacement, and each of x_s, x_t has the exact
marginal (1.1). The same mechanism makes :func:`corrupt` *monotone in α for a fixed key*: calling it twice with the
same key and two signal levels returns exactly the coupled pair.

Caveat: this monotone coupling is *not* the D3PM Markov chain x0 → x_s → x_t with kernel
q(x_t | x_s) = α_{t|s} δ(x_t = x_s) + (1 − α_{t|s})/V, α_{t|s} = α_t/α_s (1.2): under it
P(x_t ≠ x_s) = (α_s − α_t)(V − 1)/V, whereas (1.2) gives (1 − α_t/α_s)(V − 1)/V, and a corrupted x_s is never
re-drawn. No coupling can have both the shared-replacement property and kernel (1.2). For the Markov chain, draw
x_t = corrupt(key', x_s, α_t/α_s, mask) from x_s with an independent key (composition of (1.2) gives (1.1) at α_t).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = ["draw_noise", "apply_noise", "corrupt", "corrupt_coupled"]


def draw_noise(key: jax.Array, shape: tuple[int, ...], vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Draw the per-position randomness of the forward process.

    Args:
      key: PRNG key.
      shape: token array shape, e.g. (B, R).
      vocab_size: V; replacements are uniform over [0, V).

    Returns:
      (u, r): u ~ U[0, 1) float32 and r ~ Unif{0 … V−1} int32, both of ``shape``.
    """
    k_u, k_r = jax.random.split(key)
    u = jax.random.uniform(k_u, shape, dtype=jnp.float32)
    r = jax.random.randint(k_r, shape, 0, vocab_size, dtype=jnp.int32)
    return u, r


def apply_noise(
    x0: jax.Array,
    u: jax.Array,
    r: jax.Array,
    alpha: ArrayLike,
    corrupt_mask: jax.Array | None = None,
) -> jax.Array:
    """Deterministic part of the forward process: replace x0 by r where u < 1 − α (and ``corrupt_mask``).

    Args:
      x0: [...] int clean tokens.
      u: [...] uniforms from :func:`draw_noise`.
      r: [...] replacement tokens from :func:`draw_noise`.
      alpha: signal level α, broadcastable to ``x0`` (per token, per row or scalar).
      corrupt_mask: [...] bool, True where the token may be noised. None = everywhere.

    Returns:
      x_t with x0's shape and dtype.
    """
    alpha = jnp.asarray(alpha, jnp.float32)
    move = u < (1.0 - alpha)
    if corrupt_mask is not None:
        move = move & corrupt_mask
    return jnp.where(move, r.astype(x0.dtype), x0)


def corrupt(
    key: jax.Array,
    x0: jax.Array,
    alpha_t: ArrayLike,
    corrupt_mask: jax.Array | None,
    *,
    vocab_size: int,
) -> jax.Array:
    """Sample x_t ~ q(x_t | x0) with uniform replacement over all V ids (eq. 1.1).

    Args:
      key: PRNG key.
      x0: [B, T] (any shape) int clean tokens.
      alpha_t: signal level per token, broadcastable to x0 (e.g. ``expand_per_block(alpha, block_id)``).
      corrupt_mask: bool like x0: supervised canvas positions. Everything else (prompt, clean context, padding) is
        returned unchanged. None = corrupt every position.
      vocab_size: V.

    Returns:
      x_t, same shape/dtype as x0. Jit-able; for a fixed key it is the coupled process of :func:`corrupt_coupled`.
    """
    u, r = draw_noise(key, x0.shape, vocab_size)
    return apply_noise(x0, u, r, alpha_t, corrupt_mask)


def corrupt_coupled(
    key: jax.Array,
    x0: jax.Array,
    alpha_s: jax.Array,
    alpha_t: jax.Array,
    corrupt_mask: jax.Array | None,
    *,
    vocab_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Coupled draws (x_s, x_t) for s < t (α_s ≥ α_t) sharing uniforms and replacement tokens.

    Guarantees ``corrupted(x_s) ⊆ corrupted(x_t)`` position-wise, where "corrupted" means "replacement applied"
    (the replacement may coincidentally equal x0), and equal replacement tokens wherever both are corrupted.

    Returns:
      (x_s, x_t), each with x0's shape and dtype.
    """
    u, r = draw_noise(key, x0.shape, vocab_size)
    return apply_noise(x0, u, r, alpha_s, corrupt_mask), apply_noise(x0, u, r, alpha_t, corrupt_mask)
