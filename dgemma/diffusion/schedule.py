"""Noise schedules α_t and per-(example, block) time sampling.

Concept
-------
The forward process keeps each supervised token with probability α_t (the *signal level*) and otherwise replaces it
by a uniform draw over the whole vocabulary (see ``corruption.py``). Time runs from t = 0 (clean, α_0 = 1) to t = 1
(pure noise). dgemma's default is the linear schedule

    α_t = 1 − t,          α'_t = −1.

DiffusionGemma has **no time input**: the network only ever sees the noisy canvas. The schedule therefore only shapes
(i) which noise levels training visits and (ii) the weight in the exact ELBO (``elbo.py``), where α'_t appears. Every
schedule is a reparametrization of t; the log-linear and cosine variants are provided for ablations.

Time sampling (BD3-LM ``_sample_t``): one t per (example, block) so that every canvas of a long response is trained at
its own noise level. With ``antithetic=True`` the B·N_b draws are *stratified*: the unit interval is cut into B·N_b
equal strata and each draw falls in its own stratum,

    u_i = (ε_i + i) / (B·N_b),   ε_i ~ U(0, 1),   i = 0 … B·N_b − 1,

which keeps every marginal U(0, 1) while lowering the variance of the batch-mean loss. Unlike BD3-LM, the strata are
randomly permuted over the (example, block) grid, so an example does not receive a contiguous slice of noise levels
(BD3-LM's row-major layout gives example 0 all of [0, 1/B)). Finally t = t_min + (t_max − t_min)·u keeps t away from
the endpoints, where Δ_t = log(1 + Vα/(1 − α)) and the ELBO weight blow up.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

__all__ = [
    "Schedule",
    "alpha_linear",
    "dalpha_linear",
    "get_schedule",
    "sample_t",
    "expand_per_block",
]

ScheduleName = Literal["linear", "loglinear", "cosine"]


def alpha_linear(t: jax.Array) -> jax.Array:
    """Linear signal level α_t = 1 − t (default; Megatron-Bridge ``rf_alpha``, Google ``LinearDiscreteSchedule``)."""
    return 1.0 - t


def dalpha_linear(t: jax.Array) -> jax.Array:
    """Derivative dα_t/dt = −1 of the linear schedule, broadcast to t's shape and dtype."""
    return -jnp.ones_like(t)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """A signal-level schedule: ``alpha(t)`` with α_0 = 1, decreasing, and its derivative ``dalpha(t)`` (< 0).

    Attributes:
      name: "linear" (α = 1 − t), "loglinear" (MDLM/DUO: α = 1 − (1 − eps)·t, i.e. σ(t) = −log1p(−(1 − eps)t), so
        α_1 = eps > 0), or "cosine" (α = cos(πt/2)).
      eps: floor of α_1 for "loglinear".
    """

    name: ScheduleName = "linear"
    eps: float = 1e-3

    def __post_init__(self) -> None:
        if self.name not in ("linear", "loglinear", "cosine"):
            raise ValueError(f"unknown schedule {self.name!r}")
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"eps must be in [0, 1), got {self.eps}")

    def alpha(self, t: jax.Array) -> jax.Array:
        """Signal level α_t = P(token kept), elementwise."""
        t = jnp.asarray(t)
        if self.name == "linear":
            return alpha_linear(t)
        if self.name == "loglinear":
            return 1.0 - (1.0 - self.eps) * t
        return jnp.cos(0.5 * math.pi * t)

    def dalpha(self, t: jax.Array) -> jax.Array:
        """Derivative α'_t = dα/dt (≤ 0), elementwise."""
        t = jnp.asarray(t)
        if self.name == "linear":
            return dalpha_linear(t)
        if self.name == "loglinear":
            return jnp.full_like(t, -(1.0 - self.eps))
        return -0.5 * math.pi * jnp.sin(0.5 * math.pi * t)

    def alpha_and_dalpha(self, t: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Both α_t and α'_t."""
        return self.alpha(t), self.dalpha(t)


def get_schedule(name: ScheduleName = "linear", **kwargs) -> Schedule:
    """Build a :class:`Schedule` by name."""
    return Schedule(name=name, **kwargs)


def sample_t(
    key: jax.Array,
    batch: int,
    n_blocks: int,
    t_min: float = 1e-3,
    t_max: float = 1.0 - 1e-3,
    antithetic: bool = True,
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """Draw one diffusion time per (example, block).

    Args:
      key: PRNG key.
      batch: B, number of examples.
      n_blocks: N_b, canvases (blocks) per example. Use 1 for "one t per example".
      t_min, t_max: clip range; t = t_min + (t_max − t_min)·u.
      antithetic: stratify u over the B·N_b draws (one draw per stratum, strata randomly permuted over the grid).
        If False, u is i.i.d. U(0, 1).
      dtype: output dtype.

    Returns:
      t: [B, N_b] array in [t_min, t_max].
    """
    if not 0.0 <= t_min < t_max <= 1.0:
        raise ValueError(f"need 0 <= t_min < t_max <= 1, got {t_min}, {t_max}")
    n = batch * n_blocks
    k_eps, k_perm = jax.random.split(key)
    eps = jax.random.uniform(k_eps, (n,), dtype=jnp.float32)
    if antithetic:
        strata = jax.random.permutation(k_perm, n).astype(jnp.float32)
        u = (eps + strata) / n
        u = jnp.minimum(u, 1.0)  # guards the fp32 rounding of (eps + n - 1)/n
    else:
        u = eps
    t = t_min + (t_max - t_min) * u
    return t.reshape(batch, n_blocks).astype(dtype)


def expand_per_block(
    values: jax.Array, block_id: jax.Array, fill: float | int = 0
) -> jax.Array:
    """Gather per-block values (e.g. t or α_t, shape [B, N_b]) to per-token values ([B, T]).

    Tokens with ``block_id < 0`` (prompt −1, padding/unused −2) receive ``fill``.

    Args:
      values: [B, N_b] per-(example, block) values.
      block_id: [B, T] int block index of each token.
      fill: value for tokens outside any response block.

    Returns:
      [B, T] array with ``values[b, block_id[b, j]]`` where the block id is valid.
    """
    nb = values.shape[1]
    idx = jnp.clip(block_id, 0, nb - 1)
    gathered = jnp.take_along_axis(values, idx, axis=1)
    return jnp.where(block_id >= 0, gathered, jnp.asarray(fill, values.dtype))

