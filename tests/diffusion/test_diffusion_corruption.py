"""Schedules, time sampling and the uniform forward process (docs/stage1.md §1, §2)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma.diffusion.corruption import corrupt, corrupt_coupled
from dgemma.diffusion.schedule import Schedule, expand_per_block, sample_t


def chi2_sf(stat: float, df: int) -> float:
    """Upper tail of χ²(df) via the Wilson–Hilferty cube-root normal approximation (accurate for df ≳ 30)."""
    z = ((stat / df) ** (1.0 / 3.0) - (1.0 - 2.0 / (9.0 * df))) / math.sqrt(2.0 / (9.0 * df))
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def chi2_uniform_pvalue(samples: np.ndarray, support: np.ndarray) -> float:
    counts = np.array([(samples == v).sum() for v in support], dtype=np.float64)
    expected = counts.sum() / len(support)
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_sf(stat, len(support) - 1)


# MARK: schedules and t sampling


@pytest.mark.parametrize("name", ["linear", "loglinear", "cosine"])
def test_schedule_endpoints_and_derivative(name):
    sched = Schedule(name=name)
    t = jnp.linspace(0.05, 0.95, 19)
    assert float(sched.alpha(jnp.asarray(0.0))) == pytest.approx(1.0)
    a = np.asarray(sched.alpha(t))
    assert np.all(np.diff(a) < 0)
    h = 1e-3
    fd = (np.asarray(sched.alpha(t + h)) - np.asarray(sched.alpha(t - h))) / (2 * h)
    np.testing.assert_allclose(np.asarray(sched.dalpha(t)), fd, rtol=1e-3, atol=1e-4)


def test_linear_schedule_values():
    t = jnp.array([0.25, 0.5])
    np.testing.assert_allclose(np.asarray(Schedule().alpha(t)), [0.75, 0.5])
    np.testing.assert_allclose(np.asarray(Schedule().dalpha(t)), [-1.0, -1.0])


def test_sample_t_stratified_and_clipped():
    b, nb, t_min, t_max = 16, 8, 1e-3, 1 - 1e-3
    t = np.asarray(sample_t(jax.random.key(0), b, nb, t_min, t_max), np.float64)
    assert t.shape == (b, nb)
    assert t.min() >= t_min and t.max() <= t_max
    u = (t - t_min) / (t_max - t_min)
    # exactly one draw per stratum [i/n, (i+1)/n)
    strata = np.floor(np.sort(u.ravel()) * b * nb + 1e-6)
    np.testing.assert_array_equal(strata, np.arange(b * nb))
    # strata are permuted: an example does not get a contiguous slice of noise levels
    assert np.ptp(u, axis=1).mean() > 0.5


def test_sample_t_marginal_uniform():
    # Each (example, block) cell is marginally U(t_min, t_max): average the cell over many keys.
    keys = jax.random.split(jax.random.key(1), 2000)
    t = np.asarray(jax.jit(jax.vmap(lambda k: sample_t(k, 2, 3)))(keys))  # [K, 2, 3]
    m = t.mean(axis=0)
    sigma = math.sqrt(1 / 12 / len(keys))
    assert np.all(np.abs(m - 0.5) < 4 * sigma)
    iid = np.asarray(sample_t(jax.random.key(2), 64, 4, antithetic=False))
    assert iid.shape == (64, 4) and iid.min() >= 1e-3 and iid.max() <= 1 - 1e-3


def test_expand_per_block():
    values = jnp.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    block_id = jnp.array([[-2, -1, 0, 0, 1, 2], [-1, -1, 2, 2, -2, -2]])
    out = np.asarray(expand_per_block(values, block_id, fill=1.0))
    np.testing.assert_allclose(out, [[1, 1, 0.1, 0.1, 0.2, 0.3], [1, 1, 0.6, 0.6, 1, 1]])


# MARK: forward process statistics


def test_forward_process_statistics():
    vocab, b, r = 64, 64, 4096
    alphas = np.array([0.0, 0.1, 0.5, 0.9, 1.0], np.float32)
    k_x, k_m, k_n = jax.random.split(jax.random.key(3), 3)
    x0 = jax.random.randint(k_x, (b, r), 0, vocab)
    alpha_row = jnp.asarray(np.resize(alphas, b))[:, None]  # rows cycle through the alphas
    corrupt_mask = jax.random.bernoulli(k_m, 0.75, (b, r))
    x_t = jax.jit(corrupt, static_argnames="vocab_size")(k_n, x0, alpha_row, corrupt_mask, vocab_size=vocab)
    x0, x_t, m = np.asarray(x0), np.asarray(x_t), np.asarray(corrupt_mask)
    assert x_t.dtype == x0.dtype and x_t.min() >= 0 and x_t.max() < vocab

    # positions outside corrupt_mask (prompt, clean context, padding) are never touched
    np.testing.assert_array_equal(x_t[~m], x0[~m])

    row_alpha = np.resize(alphas, b)
    for a in alphas:
        rows = row_alpha == a
        same = (x_t[rows] == x0[rows])[m[rows]]
        p = a + (1 - a) / vocab
        n = same.size
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(same.mean() - p) <= 4 * sigma + 1e-12, (a, same.mean(), p)

    # α = 0: x_t is exactly uniform over all V ids (incl. ids that never occur in data)
    rows0 = row_alpha == 0.0
    draws0 = x_t[rows0][m[rows0]]
    assert chi2_uniform_pvalue(draws0, np.arange(vocab)) > 1e-3
    # α = 0.5: replacements that differ from x0, shifted by x0, are uniform over the other V − 1 ids
    rows5 = row_alpha == 0.5
    moved = (x_t[rows5] != x0[rows5]) & m[rows5]
    offset = (x_t[rows5][moved] - x0[rows5][moved]) % vocab
    assert chi2_uniform_pvalue(offset, np.arange(1, vocab)) > 1e-3


def test_chi2_detects_nonuniform():
    # the histogram check can fail: a replacement draw over V − 8 ids is rejected
    rng = np.random.default_rng(0)
    draws = rng.integers(0, 56, size=200_000)
    assert chi2_uniform_pvalue(draws, np.arange(64)) < 1e-3


def test_corrupt_per_token_alpha_broadcast():
    x0 = jnp.zeros((2, 6), jnp.int32)
    alpha = jnp.array([[1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 1, 0]], jnp.float32)
    x_t = np.asarray(corrupt(jax.random.key(0), x0, alpha, None, vocab_size=1_000_000))
    assert np.all(x_t[np.asarray(alpha) == 1] == 0)
    assert np.all(x_t[np.asarray(alpha) == 0] != 0)  # P(replacement == 0) = 1e-6 per draw


# MARK: coupled noise


def test_coupled_noise_subset_and_shared_replacements():
    vocab, shape = 50, (32, 2048)
    k_x, k_m, k_n = jax.random.split(jax.random.key(5), 3)
    x0 = jax.random.randint(k_x, shape, 0, vocab)
    mask = jax.random.bernoulli(k_m, 0.8, shape)
    a_s = jnp.linspace(0.3, 0.95, shape[0])[:, None]
    a_t = a_s * jnp.linspace(0.2, 0.9, shape[0])[:, None]  # α_t < α_s
    x_s, x_t = corrupt_coupled(k_n, x0, a_s, a_t, mask, vocab_size=vocab)
    x0, x_s, x_t, mask = map(np.asarray, (x0, x_s, x_t, mask))

    changed_s, changed_t = x_s != x0, x_t != x0
    assert np.all(changed_t[changed_s])  # corrupted(s) ⊆ corrupted(t)
    np.testing.assert_array_equal(x_t[changed_s], x_s[changed_s])  # same replacement tokens
    assert np.all(x_s[~mask] == x0[~mask]) and np.all(x_t[~mask] == x0[~mask])
    assert changed_t.sum() > changed_s.sum() > 0

    # for a fixed key, `corrupt` is the same coupling (monotone in α)
    for a, want in ((a_s, x_s), (a_t, x_t)):
        got = corrupt(k_n, jnp.asarray(x0), a, jnp.asarray(mask), vocab_size=vocab)
        np.testing.assert_array_equal(np.asarray(got), want)

    # both marginals are exact (1.1); disagreement rate is the monotone-coupling value (α_s − α_t)(V − 1)/V
    a_s_np, a_t_np = np.asarray(a_s)[:, 0], np.asarray(a_t)[:, 0]
    n = mask.sum()
    for x, a in ((x_s, a_s_np), (x_t, a_t_np)):
        p = a + (1 - a) / vocab
        expected = float((p[:, None] * mask).sum())
        var = float((p * (1 - p))[:, None].repeat(shape[1], 1)[mask].sum())
        assert abs(float((x == x0)[mask].sum()) - expected) < 4 * math.sqrt(var)
    p_diff = (a_s_np - a_t_np) * (vocab - 1) / vocab
    expected = float((p_diff[:, None] * mask).sum())
    var = float((p_diff * (1 - p_diff))[:, None].repeat(shape[1], 1)[mask].sum())
    assert abs(float((x_s != x_t)[mask].sum()) - expected) < 4 * math.sqrt(var)
    assert n > 0


def test_markov_composition_from_x_s():
    # drawing x_t from x_s with α_{t|s} = α_t/α_s (independent key) composes to the marginal (1.1) at α_t
    vocab, shape, a_s, a_t = 20, (8, 8192), 0.8, 0.3
    k_x, k1, k2 = jax.random.split(jax.random.key(9), 3)
    x0 = jax.random.randint(k_x, shape, 0, vocab)
    x_s = corrupt(k1, x0, a_s, None, vocab_size=vocab)
    x_t = corrupt(k2, x_s, a_t / a_s, None, vocab_size=vocab)
    p = a_t + (1 - a_t) / vocab
    n = x0.size
    frac = float(jnp.mean(x_t == x0))
    assert abs(frac - p) < 4 * math.sqrt(p * (1 - p) / n)
