"""Bridge posterior, denoiser ↔ LOO logits and the exact ancestral step (docs/stage1.md §3, docs/sampler.md §5)."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.diffusion.posterior import (
    ancestral_step,
    ancestral_step_from_logits,
    ancestral_step_probs,
    bridge_posterior,
    denoiser_to_loo_logits,
    loo_to_denoiser_logits,
)

V = 7
ALPHA_PAIRS = [(0.9, 0.5), (0.5, 0.1), (0.99, 0.98), (1.0, 0.3), (0.4, 0.0), (0.2, 0.05)]  # (α_s, α_t), s < t


def q_forward(a: float) -> np.ndarray:
    """Transition matrix Q[a, b] = q(x_t = b | x = a) = a δ + (1 − a)/V (eq. 1.1/1.2), float64."""
    return a * np.eye(V) + (1 - a) / V


def bayes_bridge(x0: int, z_t: int, a_s: float, a_t: float) -> np.ndarray:
    """Brute-force q(z_s | z_t, x0) = q(z_t | z_s) q(z_s | x0) / q(z_t | x0)."""
    a_ts = a_t / a_s if a_s > 0 else 0.0
    num = q_forward(a_ts)[:, z_t] * q_forward(a_s)[x0, :]
    return num / q_forward(a_t)[x0, z_t]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# MARK: bridge posterior


@pytest.mark.parametrize("a_s,a_t", ALPHA_PAIRS)
def test_bridge_equals_bayes_for_one_hot(a_s, a_t):
    with jax.enable_x64(True):
        xs, zs = np.meshgrid(np.arange(V), np.arange(V), indexing="ij")
        onehot = np.eye(V)[xs.ravel()]
        out = np.asarray(bridge_posterior(jnp.asarray(onehot), jnp.asarray(zs.ravel()), a_t, a_s))
    assert out.dtype == np.float64
    for i, (x0, z) in enumerate(zip(xs.ravel(), zs.ravel())):
        np.testing.assert_allclose(out[i], bayes_bridge(x0, z, a_s, a_t), rtol=0, atol=1e-12)
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=0, atol=1e-12)


def test_bridge_soft_x_sums_to_one():
    rng = np.random.default_rng(0)
    x = rng.dirichlet(np.ones(V), size=200)
    z = rng.integers(0, V, size=200)
    a_s = rng.uniform(0.2, 1.0, size=200)
    a_t = a_s * rng.uniform(0.0, 1.0, size=200)
    with jax.enable_x64(True):
        out = np.asarray(bridge_posterior(jnp.asarray(x), jnp.asarray(z), jnp.asarray(a_t), jnp.asarray(a_s)))
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=0, atol=1e-12)
    assert out.min() >= 0


# MARK: mixture of one-hot bridges and LOO conversion


def test_loo_round_trip_and_delta():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 11)).astype(np.float32)
    z = rng.integers(0, 11, size=5)
    a = np.array([0.1, 0.5, 0.9, 0.99, 0.3], np.float32)
    loo = np.asarray(denoiser_to_loo_logits(jnp.asarray(logits), jnp.asarray(z), jnp.asarray(a)))
    back = np.asarray(loo_to_denoiser_logits(jnp.asarray(loo), jnp.asarray(z), jnp.asarray(a)))
    np.testing.assert_allclose(back, logits, rtol=0, atol=1e-5)
    diff = logits - loo
    delta = np.log1p(11 * a / (1 - a))
    np.testing.assert_allclose(diff[np.arange(5), z], delta, rtol=1e-6)
    diff[np.arange(5), z] = 0
    assert np.all(diff == 0)


@pytest.mark.parametrize("a_s,a_t", [(0.9, 0.5), (0.5, 0.1), (0.99, 0.98), (1.0, 0.3), (0.3, 0.01)])
def test_mixture_of_one_hot_bridges_equals_loo_plugin(a_s, a_t):
    rng = np.random.default_rng(2)
    n = 50
    p = rng.dirichlet(np.full(V, 0.7), size=n)
    z = rng.integers(0, V, size=n)
    with jax.enable_x64(True):
        # exact reverse kernel of the denoiser p: Σ_v p(v) q(z_s | z_t, e_v)
        bridges = np.asarray(
            bridge_posterior(jnp.asarray(np.eye(V))[None], jnp.asarray(np.repeat(z[:, None], V, 1)), a_t, a_s)
        )  # [n, v, V]
        mixture = np.einsum("nv,nvw->nw", p, bridges)
        loo = softmax(np.asarray(denoiser_to_loo_logits(jnp.asarray(np.log(p)), jnp.asarray(z), a_t)))
        plug_loo = np.asarray(bridge_posterior(jnp.asarray(loo), jnp.asarray(z), a_t, a_s))
        plug_raw = np.asarray(bridge_posterior(jnp.asarray(p), jnp.asarray(z), a_t, a_s))
    np.testing.assert_allclose(plug_loo, mixture, rtol=0, atol=1e-12)
    if a_t > 0.05:  # the raw plug-in is wrong (the check above can therefore fail)
        assert np.abs(plug_raw - mixture).max() > 1e-3


# MARK: ancestral three-way step


def three_way_distribution(z: int, v: int, a_t: float, a_s: float) -> np.ndarray:
    with jax.enable_x64(True):
        p_u, p_keep = ancestral_step_probs(jnp.asarray(z), jnp.asarray(v), np.float64(a_t), np.float64(a_s), V)
        p_u, p_keep = float(p_u), float(p_keep)
    dist = np.full(V, p_u / V)
    dist[z] += (1 - p_u) * p_keep
    dist[v] += (1 - p_u) * (1 - p_keep)
    return dist


@pytest.mark.parametrize("a_s,a_t", ALPHA_PAIRS)
def test_ancestral_three_way_probabilities_are_exact(a_s, a_t):
    for z, v in itertools.product(range(V), range(V)):
        dist = three_way_distribution(z, v, a_t, a_s)
        np.testing.assert_allclose(dist, bayes_bridge(v, z, a_s, a_t), rtol=0, atol=1e-12)


def test_ancestral_step_monte_carlo():
    n = 200_000
    cases = [(2, 2, 0.6, 0.2), (2, 5, 0.6, 0.2), (0, 3, 0.95, 0.9), (4, 1, 1.0, 0.5)]  # (z, v, α_s, α_t)
    step = jax.jit(ancestral_step, static_argnames="vocab_size")
    for i, (z, v, a_s, a_t) in enumerate(cases):
        zs = jnp.full((n,), z, jnp.int32)
        vs = jnp.full((n,), v, jnp.int32)
        out = np.asarray(step(jax.random.key(i), zs, vs, a_t, a_s, vocab_size=V))
        freq = np.bincount(out, minlength=V) / n
        target = bayes_bridge(v, z, a_s, a_t)
        sigma = np.sqrt(target * (1 - target) / n)
        assert np.all(np.abs(freq - target) <= 4 * sigma + 1e-12), (z, v, freq, target)


def test_ancestral_step_returns_x0_hat_at_s0():
    z = jnp.arange(V)
    v = (z + 3) % V
    out = ancestral_step(jax.random.key(0), z, v, jnp.full((V,), 0.4), 1.0, V)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(v))


def test_ancestral_from_logits_matches_loo_plugin():
    # sample x̂0 ~ p, then the one-hot bridge: marginal is q(z_s | z_t, LOO(p)), not the raw plug-in
    n, a_s, a_t, z = 200_000, 0.7, 0.4, 3
    p = np.array([0.05, 0.1, 0.05, 0.4, 0.2, 0.1, 0.1])
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, V))
    zs = jnp.full((n,), z, jnp.int32)
    out, x0_hat = jax.jit(ancestral_step_from_logits)(jax.random.key(7), logits, zs, a_t, a_s)
    freq = np.bincount(np.asarray(out), minlength=V) / n
    with jax.enable_x64(True):
        loo = softmax(np.asarray(denoiser_to_loo_logits(jnp.asarray(np.log(p)), jnp.asarray(z), a_t)))
        target = np.asarray(bridge_posterior(jnp.asarray(loo), jnp.asarray(z), a_t, a_s))
        raw = np.asarray(bridge_posterior(jnp.asarray(p), jnp.asarray(z), a_t, a_s))
    sigma = np.sqrt(target * (1 - target) / n)
    assert np.all(np.abs(freq - target) <= 4 * sigma), (freq, target)
    assert np.abs(freq - raw).max() > 10 * sigma.max()
    x0_freq = np.bincount(np.asarray(x0_hat), minlength=V) / n
    assert np.all(np.abs(x0_freq - p) <= 4 * np.sqrt(p * (1 - p) / n))
    greedy, x0_g = ancestral_step_from_logits(jax.random.key(8), logits[:4], zs[:4], a_t, a_s, greedy=True)
    assert np.all(np.asarray(x0_g) == 3) and greedy.shape == (4,)
    assert math.isfinite(float(freq.sum()))
