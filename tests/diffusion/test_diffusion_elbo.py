"""UDLM continuous-time NELBO: reference (1.6), folded (1.8), LOO evaluator, L_prior (`dgemma/diffusion/elbo.py`, docs/stage1.md §3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.diffusion.elbo import nelbo_integrand, prior_loss, udlm_integrand_folded, udlm_integrand_reference
from dgemma.diffusion.posterior import bridge_posterior, denoiser_to_loo_logits

V = 7


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# MARK: reference (1.6) == folded (1.8)


def test_reference_equals_folded_f64():
    rng = np.random.default_rng(0)
    n = 500
    logits = rng.normal(size=(n, V)) * rng.uniform(0.0, 5.0, size=(n, 1))
    x0 = rng.integers(0, V, size=n)
    z = np.where(rng.random(n) < 0.5, x0, rng.integers(0, V, size=n))
    a = rng.uniform(1e-3, 1 - 1e-3, size=n)
    da = -rng.uniform(0.1, 3.0, size=n)
    with jax.enable_x64(True):
        ref = np.asarray(udlm_integrand_reference(jnp.asarray(softmax(logits)), *map(jnp.asarray, (x0, z, a, da))))
        fold = np.asarray(udlm_integrand_folded(jnp.asarray(logits), *map(jnp.asarray, (x0, z, a, da)), vocab_chunk=3))
        # the evaluator on denoiser logits == reference on the LOO plug-in
        loo = softmax(np.asarray(denoiser_to_loo_logits(jnp.asarray(logits), jnp.asarray(z), jnp.asarray(a))))
        ref_loo = np.asarray(udlm_integrand_reference(jnp.asarray(loo), *map(jnp.asarray, (x0, z, a, da))))
        ev = np.asarray(nelbo_integrand(jnp.asarray(logits), *map(jnp.asarray, (x0, z, a, da)), vocab_chunk=4))
    assert fold.dtype == np.float64
    np.testing.assert_allclose(fold, ref, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(ev, ref_loo, rtol=1e-8, atol=1e-10)
    assert ref.min() >= -1e-10 and ref_loo.min() >= -1e-10
    assert (z == x0).any() and (z != x0).any()


def test_exact_plugin_gives_zero():
    # ℓ = 0 iff the plug-in equals the clean one-hot; a near-one-hot gives a tiny positive value
    x0 = np.arange(V)
    with jax.enable_x64(True):
        eye = jnp.eye(V, dtype=jnp.float64)
        out = np.asarray(udlm_integrand_reference(eye, jnp.asarray(x0), jnp.asarray(x0), 0.4, -1.0))
    np.testing.assert_allclose(out, 0.0, atol=1e-12)


def test_folded_fp32_vs_fp64_full_vocab():
    vocab = 262_144
    rng = np.random.default_rng(1)
    cases = [(a, s, kept) for a in (1e-3, 0.05, 0.5, 0.95, 0.999) for s in (0.5, 30.0) for kept in (True, False)]
    n = len(cases)
    logits = np.stack([rng.normal(size=vocab) * (3.0 if s > 1 else s) for _, s, _ in cases]).astype(np.float32)
    x0 = rng.integers(0, vocab, size=n)
    for i, (_, s, _) in enumerate(cases):
        if s > 1:  # peaked: the network is confident about the clean token, giving small |ℓ|
            logits[i, x0[i]] = s
    z = np.where([k for *_, k in cases], x0, (x0 + rng.integers(1, vocab, size=n)) % vocab)
    a32 = np.array([c[0] for c in cases], np.float32)
    da = -np.ones(n, np.float32)
    out32 = np.asarray(nelbo_integrand(*map(jnp.asarray, (logits, x0, z, a32, da))))
    assert out32.dtype == np.float32
    with jax.enable_x64(True):
        a64 = a32.astype(np.float64)  # same (fp32-rounded) α: measure algorithmic error only
        lg64 = jnp.asarray(logits.astype(np.float64))
        loo = jax.nn.softmax(denoiser_to_loo_logits(lg64, jnp.asarray(z), jnp.asarray(a64)), axis=-1)
        ref64 = np.asarray(udlm_integrand_reference(loo, *map(jnp.asarray, (x0, z, a64, da.astype(np.float64)))))
    assert ref64.min() >= -1e-10
    big = np.abs(ref64) > 1e-2
    assert big.sum() >= n // 2
    rel = np.abs(out32 - ref64) / np.abs(ref64)
    assert rel[big].max() < 1e-4, (rel, ref64)
    assert np.abs(out32 - ref64)[~big].max(initial=0.0) < 1e-5


# MARK: single-token tightness, discrete-time bound


def single_token_setup(n_nodes: int):
    """Gauss–Legendre in u with t = u³ (the integrand has an endpoint singularity at t = 0)."""
    u, w = np.polynomial.legendre.leggauss(n_nodes)
    u, w = (u + 1) / 2, w / 2
    t, w = u**3, w * 3 * u**2
    rng = np.random.default_rng(3)
    pi = rng.dirichlet(np.ones(V))
    return t, w, pi


def bayes_denoiser(pi: np.ndarray, a: np.ndarray) -> np.ndarray:
    """p(x0 = v | z) ∝ π(v) q(z | v), shape [n, z, v]."""
    lik = a[:, None, None] * np.eye(V)[None] + (1 - a[:, None, None]) / V
    p = pi[None, None, :] * lik
    return p / p.sum(-1, keepdims=True)


def test_single_token_tightness():
    t, w, pi = single_token_setup(100)
    a = 1 - t
    n = len(t)
    p = bayes_denoiser(pi, a)  # [n, z, v]
    xs = np.arange(V)
    q_z = a[:, None, None] * np.eye(V)[None] + (1 - a[:, None, None]) / V  # [n, x0, z]
    pb = np.broadcast_to(p[:, None], (n, V, V, V))  # [n, x0, z, v]
    x0 = np.broadcast_to(xs[None, :, None], (n, V, V))
    z = np.broadcast_to(xs[None, None, :], (n, V, V))
    aa = np.broadcast_to(a[:, None, None], (n, V, V))
    da = -np.ones((n, V, V))
    with jax.enable_x64(True):
        l_loo = np.asarray(nelbo_integrand(jnp.asarray(np.log(pb)), *map(jnp.asarray, (x0, z, aa, da))))
        l_raw = np.asarray(udlm_integrand_reference(jnp.asarray(pb), *map(jnp.asarray, (x0, z, aa, da))))
    nelbo_loo = np.einsum("n,nxz->x", w, q_z * l_loo)
    nelbo_raw = np.einsum("n,nxz->x", w, q_z * l_raw)
    # L_prior = 0 at α_1 = 0 and L_recon = 0 in continuous time: the LOO plug-in is exactly −log π(x0)
    np.testing.assert_allclose(nelbo_loo, -np.log(pi), rtol=0, atol=1e-5)
    # The raw plug-in p is a different (wrong) model: its bound is looser on average over x0 ~ π (cross-entropy
    # ≥ entropy), and for the likely tokens, but not for every x0 (a rare token can get a smaller value).
    assert pi @ nelbo_raw - pi @ nelbo_loo > 1e-2
    likely = pi > 1 / V
    assert likely.any() and np.all(nelbo_raw[likely] - nelbo_loo[likely] > 1e-2)


def discrete_nelbos(x_theta_of_a, step_counts: tuple[int, ...]) -> list[np.ndarray]:
    """T-step D3PM bounds Σ_n E_{z_t ~ q(·|x0)} KL(q(z_s|z_t,x0) ‖ q(z_s|z_t,x_θ)) for every x0, one [V] per T.

    α = 1 − t on the grid t_n = n/T; L_prior = 0 at α_1 = 0; the n = 1 term (s = 0) is the reconstruction term.
    The true posterior is brute-force Bayes; the model posterior is the module's (1.3), evaluated for all T at once.
    """
    grids = [np.arange(1, n + 1) / n for n in step_counts]
    t = np.concatenate(grids)
    a_t = 1 - t
    a_s = np.concatenate([1 - (g - 1 / len(g)) for g in grids])
    zs = np.broadcast_to(np.arange(V), (len(t), V))
    xth = x_theta_of_a(a_t)  # [N, z, v]
    with jax.enable_x64(True):
        q_model = np.asarray(bridge_posterior(jnp.asarray(xth), jnp.asarray(zs), jnp.asarray(a_t[:, None]),
                                              jnp.asarray(a_s[:, None])))  # [N, z, V]
    # brute-force Bayes: q(z_s | z_t, x0) = q(z_t | z_s) q(z_s | x0) / q(z_t | x0), shape [N, x0, z_t, z_s]
    eye = np.eye(V)
    a_ts = (a_t / a_s)[:, None, None, None]
    q_t_given_s = a_ts * eye.T[None, None] + (1 - a_ts) / V  # [.., z_t, z_s]
    q_s_given_x = a_s[:, None, None, None] * eye[None, :, None, :] + (1 - a_s[:, None, None, None]) / V
    q_t_given_x = a_t[:, None, None] * eye[None] + (1 - a_t[:, None, None]) / V  # [N, x0, z_t]
    q_true = q_t_given_s * q_s_given_x / q_t_given_x[..., None]
    safe = np.where(q_true > 0, q_true, 1.0)
    kl = np.where(q_true > 0, q_true * (np.log(safe) - np.log(q_model)[:, None]), 0.0).sum(-1)  # [N, x0, z]
    per_step = (q_t_given_x * kl).sum(-1)  # [N, x0]
    bounds = np.split(per_step, np.cumsum(step_counts)[:-1])
    return [b.sum(0) for b in bounds]


def test_discrete_time_bound():
    _, _, pi = single_token_setup(4)

    def loo(a):  # LOO of the Bayes denoiser (it equals the prior π for a single token)
        p = bayes_denoiser(pi, a)
        zz = np.broadcast_to(np.arange(V), p.shape[:2])
        with jax.enable_x64(True):
            lg = denoiser_to_loo_logits(jnp.asarray(np.log(p)), jnp.asarray(zz), jnp.asarray(a[:, None]))
        return softmax(np.asarray(lg))

    steps = (1, 4, 16, 64, 256, 1024)
    for bound in discrete_nelbos(loo, steps):
        np.testing.assert_allclose(bound, -np.log(pi), rtol=0, atol=1e-6)
    raw = np.stack(discrete_nelbos(lambda a: bayes_denoiser(pi, a), steps[1:]))  # [T, x0]
    # in expectation over x0 ~ π the raw plug-in gets worse with more steps (pointwise it need not: rare tokens improve)
    assert np.all(np.diff(raw @ pi) > 0)
    assert raw[0] @ pi - pi @ -np.log(pi) > 1e-2

    # it approaches the continuous raw plug-in value (quadrature)
    t, w, _ = single_token_setup(200)
    a = 1 - t
    n = len(t)
    p = np.broadcast_to(bayes_denoiser(pi, a)[:, None], (n, V, V, V))  # [n, x0, z, v]
    x0 = np.broadcast_to(np.arange(V)[None, :, None], (n, V, V))
    z = np.broadcast_to(np.arange(V)[None, None, :], (n, V, V))
    q_z = a[:, None, None] * np.eye(V)[None] + (1 - a[:, None, None]) / V
    with jax.enable_x64(True):
        l_raw = np.asarray(udlm_integrand_reference(jnp.asarray(p), jnp.asarray(x0), jnp.asarray(z),
                                                    jnp.asarray(np.broadcast_to(a[:, None, None], (n, V, V))), -1.0))
    raw_inf = np.einsum("n,nxz->x", w, q_z * l_raw)
    err = np.abs(raw - raw_inf[None])
    assert np.all(err[-1] < err[0]) and err[-1].max() < 1e-2


# MARK: L_prior


@pytest.mark.parametrize("vocab,a1", [(7, 0.3), (262_144, 1e-3), (50, 0.0)])
def test_prior_loss_is_kl_to_uniform(vocab, a1):
    keep = a1 + (1 - a1) / vocab
    move = (1 - a1) / vocab
    kl = keep * np.log(keep * vocab) + (vocab - 1) * (move * np.log(move * vocab) if move > 0 else 0.0)
    with jax.enable_x64(True):
        got = float(prior_loss(np.float64(a1), vocab))
    assert got == pytest.approx(kl, abs=1e-12)
    if vocab == 262_144:
        assert got == pytest.approx(4.6e-3, abs=5e-5)
