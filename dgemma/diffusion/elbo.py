"""Exact continuous-time NELBO of uniform-noise diffusion (UDLM / DUO), for **evaluation**.

Concept
-------
For one position with clean token x0 (one-hot x), noisy token z = x_t and a plug-in clean distribution x_θ,

    x̄ = V α_t x + (1 − α_t) 1,      x̄_θ = V α_t x_θ + (1 − α_t) 1
    ℓ_t = (α'_t / (V α_t)) · [ V/x̄_z − V/x̄_θ,z − Σ_v (x̄_v/x̄_z) · log( (x̄_θ,z x̄_v) / (x̄_θ,v x̄_z) ) ]    (1.6)
    NELBO(x0) = E_{t~U(0,1)} E_{x_t} Σ_j ℓ_t^j + L_prior + L_recon                                        (1.7)

ℓ_t ≥ 0. :func:`udlm_integrand_reference` is (1.6) verbatim (V-vectors; use it in float64 at small V).

Why the LOO conversion (docs/stage1.md §3)
------------------------------------------
The plug-in x_θ must be the **leave-one-out** posterior, not the CE-trained denoiser p: (1.3) and hence (1.6) are
nonlinear in x_θ, and the exact reverse kernel of p equals the plug-in of LOO(p). With the Bayes denoiser, the LOO
plug-in makes (1.7) exactly −log p(x0), while the raw plug-in bounds the likelihood of a *different* (wrong) reverse
model: looser on average over the data (e.g. 2.754 vs 2.196 nats for x0 = 0 in tests/diffusion/test_diffusion_elbo.py's example), though a rare token
can get a smaller value. :func:`nelbo_integrand` therefore takes *denoiser* logits and subtracts
Δ_t = log(1 + Vα/(1 − α)) at x_t internally. The evaluator knows α_t, so this is free.

Folded fp32-safe form (1.8)
---------------------------
With a = α_t, a' = α'_t, r = Va/(1 − a), p = softmax(plug-in logits), u_v = 1 + r p_v and S = Σ_v log u_v:

    z = x:  ℓ = a'/(a(1−a)) (1/(1+r) − 1/u_z) − a'/(Va) [ (V log u_z − S)/(1+r) − (V−1) log(1+r)/(1+r) ]
    z ≠ x:  ℓ = a'/(a(1−a)) (1 − 1/u_z) − a'/(Va) (V log u_z − S) + a'/(1−a) (log u_x − log u_z)
              − a'(1+r)/(Va) log(1+r)

All log(1 − a) pieces cancel analytically, so every term is O(log V/(1 − a)) rather than O(r log r) ≈ 3e6 at
V = 262,144. S is accumulated over vocabulary chunks (two passes: online logsumexp, then Σ log1p(r p)), so no [N, V]
fp32 intermediate is created beyond one [N, chunk] slab.

The implementation regroups (1.8) algebraically (same value) to remove the remaining fp32 cancellations:
S = log u_z + S_{v≠z}; 1/(1+r) − 1/u_z = −r(1 − p_z)/((1+r)u_z); and for z ≠ x the two O(log(1+r)/(1 − a)) terms
combine into a'/(1 − a)·(log(u_x/(1+r)) − log u_z − log(1+r)/r), where log(u/(1+r)) = log1p(−r(1 − p)/(1 + r)) with
1 − p = Σ_{v≠·} p_v accumulated directly. Without this, a confident correct prediction on a corrupted token at
α = 0.999 (true ℓ ≈ 7e-4) comes out as 0 in fp32.

Monte-Carlo use: with one t ~ U(t_min, t_max) per block, (t_max − t_min)·Σ_j ℓ_t^j estimates the integral over
[t_min, t_max]; add L_prior (:func:`prior_loss`, at α_{t_max}) and L_recon = −log p_θ(x0 | x_{t_min}) (a plain CE).
The integrand is heavy-tailed (corrupted tokens at α → 1 give ~1e4), which is why this is a metric, not the loss.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dgemma.diffusion.posterior import loo_delta

__all__ = [
    "udlm_integrand_reference",
    "udlm_integrand_folded",
    "nelbo_integrand",
    "prior_loss",
]


def udlm_integrand_reference(
    x_theta: jax.Array, x0: jax.Array, z: jax.Array, alpha_t: jax.Array, dalpha_t: jax.Array
) -> jax.Array:
    """Eq. (1.6) verbatim, materializing V-vectors (reference form; use float64 and small V).

    Args:
      x_theta: [..., V] plug-in clean distribution (LOO-converted for a trained denoiser).
      x0: [...] int clean tokens.
      z: [...] int noisy tokens x_t.
      alpha_t, dalpha_t: α_t ∈ (0, 1) and α'_t, broadcastable to x0's shape.

    Returns:
      [...] per-position integrand ℓ_t in x_theta's dtype.
    """
    vocab = x_theta.shape[-1]
    dtype = x_theta.dtype
    a = jnp.asarray(alpha_t, dtype)[..., None]
    da = jnp.asarray(dalpha_t, dtype)[..., None]
    x = jax.nn.one_hot(x0, vocab, dtype=dtype)
    xbar = vocab * a * x + (1.0 - a)
    xbar_th = vocab * a * x_theta + (1.0 - a)
    zi = z[..., None].astype(jnp.int32)
    xbar_z = jnp.take_along_axis(xbar, zi, axis=-1)
    xbar_th_z = jnp.take_along_axis(xbar_th, zi, axis=-1)
    log_ratio = jnp.log(xbar_th_z) + jnp.log(xbar) - jnp.log(xbar_th) - jnp.log(xbar_z)
    bracket = vocab / xbar_z - vocab / xbar_th_z - jnp.sum(xbar / xbar_z * log_ratio, axis=-1, keepdims=True)
    return (da / (vocab * a) * bracket)[..., 0]


class _VocabStats(NamedTuple):
    lse: jax.Array  # logsumexp of the plug-in logits
    s_not_z: jax.Array  # Σ_{v≠z} log1p(r p_v)
    q_x: jax.Array  # 1 − p_x = Σ_{v≠x} p_v (accurate when p_x ≈ 1)
    q_z: jax.Array  # 1 − p_z = Σ_{v≠z} p_v


def _chunked_vocab_stats(
    logits: jax.Array, x0: jax.Array, z: jax.Array, shift: jax.Array, r: jax.Array, vocab_chunk: int
) -> _VocabStats:
    """Vocabulary reductions of the plug-in p = softmax(l − shift·onehot(z)) in two chunked passes.

    logits: [N, V'] any float dtype; x0, z: [N] int; shift, r: [N] in the compute dtype (fp32, or f64 for references).
    Chunks are read with dynamic_slice; the last chunk is clamped to end at V' and its already-seen entries are masked
    out, so no padding copy is made. Pass 1 is an online logsumexp; pass 2 accumulates the three sums.
    """
    n, vocab = logits.shape
    cdt = r.dtype
    chunk = min(vocab_chunk, vocab)
    num_chunks = -(-vocab // chunk)
    xi, zi = x0.astype(jnp.int32)[:, None], z.astype(jnp.int32)[:, None]

    def load(i):
        lo = i * chunk
        start = jnp.minimum(lo, vocab - chunk)
        l = jax.lax.dynamic_slice_in_dim(logits, start, chunk, axis=1).astype(cdt)
        gidx = start + jax.lax.broadcasted_iota(jnp.int32, (n, chunk), 1)
        l = jnp.where(gidx == zi, l - shift[:, None], l)
        return l, gidx, gidx >= lo

    def lse_body(i, carry):
        m, acc = carry
        l, _, fresh = load(i)
        m_new = jnp.maximum(m, jnp.max(jnp.where(fresh, l, -jnp.inf), axis=1))
        acc = acc * jnp.exp(m - m_new) + jnp.sum(jnp.where(fresh, jnp.exp(l - m_new[:, None]), 0.0), axis=1)
        return m_new, acc

    m0 = jnp.full((n,), -jnp.inf, cdt)
    m, acc = jax.lax.fori_loop(0, num_chunks, lse_body, (m0, jnp.zeros((n,), cdt)))
    lse = m + jnp.log(acc)

    def sum_body(i, carry):
        s_nz, q_x, q_z = carry
        l, gidx, fresh = load(i)
        p = jnp.where(fresh, jnp.exp(l - lse[:, None]), 0.0)
        not_z = gidx != zi
        s_nz = s_nz + jnp.sum(jnp.where(not_z, jnp.log1p(r[:, None] * p), 0.0), axis=1)
        q_x = q_x + jnp.sum(jnp.where(gidx != xi, p, 0.0), axis=1)
        q_z = q_z + jnp.sum(jnp.where(not_z, p, 0.0), axis=1)
        return s_nz, q_x, q_z

    zeros = jnp.zeros((n,), cdt)
    s_nz, q_x, q_z = jax.lax.fori_loop(0, num_chunks, sum_body, (zeros, zeros, zeros))
    return _VocabStats(lse, s_nz, q_x, q_z)


def _log_u_over_1pr(p: jax.Array, q: jax.Array, log_u: jax.Array, r: jax.Array, log1r: jax.Array) -> jax.Array:
    """log(u/(1 + r)) with u = 1 + r p, q = 1 − p: log1p(−r q/(1 + r)) when p > 1/2 (no cancellation), else a
    plain difference (|result| ≥ log 2 there, so the difference is well conditioned)."""
    return jnp.where(p > 0.5, jnp.log1p(-r * q / (1.0 + r)), log_u - log1r)


def _folded(
    logits: jax.Array,
    x0: jax.Array,
    z: jax.Array,
    alpha_t: jax.Array,
    dalpha_t: jax.Array,
    shift: jax.Array | None,
    vocab_size: int | None,
    vocab_chunk: int,
) -> jax.Array:
    """(1.8), regrouped so that no two O(log r/(1 − a)) terms cancel (see the module docstring)."""
    batch_shape = x0.shape
    vocab = vocab_size or logits.shape[-1]
    lg = logits.reshape(-1, logits.shape[-1])
    x0f = x0.reshape(-1).astype(jnp.int32)
    zf = z.reshape(-1).astype(jnp.int32)
    cdt = jnp.promote_types(logits.dtype, jnp.float32)  # fp32, or f64 for f64 references
    a = jnp.broadcast_to(jnp.asarray(alpha_t, cdt), batch_shape).reshape(-1)
    da = jnp.broadcast_to(jnp.asarray(dalpha_t, cdt), batch_shape).reshape(-1)
    sh = jnp.zeros_like(a) if shift is None else jnp.broadcast_to(jnp.asarray(shift, cdt), batch_shape).reshape(-1)

    one_m_a = 1.0 - a
    r = vocab * a / one_m_a
    log1r = jnp.log1p(r)
    inv1r = 1.0 / (1.0 + r)
    st = _chunked_vocab_stats(lg, x0f, zf, sh, r, vocab_chunk)

    l_z = jnp.take_along_axis(lg, zf[:, None], axis=1)[:, 0].astype(cdt) - sh
    l_x = jnp.take_along_axis(lg, x0f[:, None], axis=1)[:, 0].astype(cdt)
    l_x = jnp.where(x0f == zf, l_z, l_x)  # the shift applies at z, which is x for kept tokens
    p_z = jnp.exp(l_z - st.lse)
    p_x = jnp.exp(l_x - st.lse)
    u_z = 1.0 + r * p_z
    log_u_z = jnp.log1p(r * p_z)
    log_u_x = jnp.log1p(r * p_x)
    lrz = _log_u_over_1pr(p_z, st.q_z, log_u_z, r, log1r)  # log(u_z/(1+r)) <= 0
    lrx = _log_u_over_1pr(p_x, st.q_x, log_u_x, r, log1r)

    c1 = da / (a * one_m_a)  # a'/(a(1-a))
    c2 = da / (vocab * a)  # a'/(V a)
    # V log u_z - S = (V-1) log u_z - S_{not z}
    #   kept:   c1 (1/(1+r) - 1/u_z) = -c1 r q_z / ((1+r) u_z);  (V log u_z - S) - (V-1) log(1+r) = (V-1) lrz - S_nz
    #   corr.:  a'/(1-a)(log u_x - log u_z) - a'(1+r)/(Va) log(1+r) = a'/(1-a) (lrx - log u_z - log(1+r)/r)
    kept = -c1 * r * st.q_z * inv1r / u_z - c2 * inv1r * ((vocab - 1) * lrz - st.s_not_z)
    corrupted = (
        c1 * r * p_z / u_z
        - c2 * ((vocab - 1) * log_u_z - st.s_not_z)
        + da / one_m_a * (lrx - log_u_z - log1r / r)
    )
    out = jnp.where(x0f == zf, kept, corrupted)
    return out.reshape(batch_shape)


def udlm_integrand_folded(logits: jax.Array, x0: jax.Array, z: jax.Array, alpha_t: jax.Array, dalpha_t: jax.Array,
                          *, vocab_size: int | None = None, vocab_chunk: int = 16384) -> jax.Array:
    """Eq. (1.8) in fp32 for a plug-in distribution given by ``logits`` (already LOO-converted).

    Args:
      logits: [..., V] plug-in logits (any float dtype; read chunk-wise and upcast to fp32).
      x0: [...] int clean tokens.
      z: [...] int noisy tokens x_t.
      alpha_t, dalpha_t: α_t ∈ (0, 1) and α'_t, broadcastable to x0's shape.
      vocab_size: V of the forward process (defaults to ``logits.shape[-1]``).
      vocab_chunk: vocabulary chunk length for S and the logsumexp.

    Returns:
      [...] float32 integrand ℓ_t.
    """
    return _folded(logits, x0, z, alpha_t, dalpha_t, None, vocab_size, vocab_chunk)


def nelbo_integrand(logits_denoiser: jax.Array, x0: jax.Array, x_t: jax.Array, alpha_t: jax.Array,
                    dalpha_t: jax.Array, *, vocab_size: int | None = None, vocab_chunk: int = 16384) -> jax.Array:
    """Per-position UDLM NELBO integrand from **denoiser** logits (a CE-trained network's output).

    Converts to the leave-one-out plug-in internally (logits − Δ_t·onehot(x_t), eq. 1.5; see module docstring for
    why the raw denoiser must not be plugged in), then evaluates the folded fp32 form (1.8).

    Args:
      logits_denoiser: [..., V] network logits for x0 given the canvas x_t (soft-capped, any float dtype).
      x0: [...] int clean tokens.
      x_t: [...] int noisy canvas tokens.
      alpha_t: α_t per position (or broadcastable), in (0, 1).
      dalpha_t: α'_t per position (or broadcastable), ≤ 0.
      vocab_size: V of the forward process (defaults to ``logits.shape[-1]``).
      vocab_chunk: vocabulary chunk length.

    Returns:
      [...] float32 ℓ_t ≥ 0 (up to rounding). Mask/sum over supervised canvas positions yourself.
    """
    vocab = vocab_size or logits_denoiser.shape[-1]
    delta = loo_delta(jnp.asarray(alpha_t, jnp.promote_types(logits_denoiser.dtype, jnp.float32)), vocab)
    return _folded(logits_denoiser, x0, x_t, alpha_t, dalpha_t, delta, vocab_size, vocab_chunk)


def prior_loss(alpha_1: jax.typing.ArrayLike, vocab_size: int) -> jax.Array:
    """L_prior per token = KL(q(x_1 | x0) ‖ Unif(V)) at the final signal level α_1.

        L_prior = (α_1 + (1 − α_1)/V) log(V α_1 + 1 − α_1) + (1 − 1/V)(1 − α_1) log(1 − α_1)

    ≈ 4.6e-3 nats/token at V = 262,144 and α_1 = 1e-3; exactly 0 at α_1 = 0.
    """
    a = jnp.asarray(alpha_1)
    v = vocab_size
    keep = (a + (1.0 - a) / v) * jnp.log(v * a + 1.0 - a)
    return keep + (1.0 - 1.0 / v) * jax.scipy.special.xlogy(1.0 - a, 1.0 - a)
