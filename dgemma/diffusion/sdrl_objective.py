"""SD·RL objective math (docs/sdrl.md §2), on plain arrays: advantages, PPO surrogate, gated SD, KL.

    L_SD·RL = w_pg L_PG + λ_SD L_SD + β L_KL + λ_anc L_anc                                              (4.2)

Every term is a sum over (state row r, canvas position j) pairs with one weight per row,

    pair_weight[r] = 1 / (R · n_i)          i = rollout of row r, n_i = its used (state, position) pairs, R rollouts

so each rollout contributes the mean over its own pairs and the rollouts are averaged (the 1/G Σ_i 1/(|S_i| L) of
(4.2), with the average over the pairs actually used). Weights are fixed once per iteration, before the inner
epochs, so a minibatch of rows gives an unbiased piece of the same loss.

    L_PG  = −Σ_r w_r Σ_j m^PG_rj  min(ρ_rj Â_r, clip(ρ_rj, 1 − ε, 1 + ε) Â_r),   ρ = exp(log π_θ(o) − log π_old(o))
    L_SD  =  Σ_r w_r ω_r Σ_j m^SD_rj (−log π_θ(y*_j))      m^SD = valid ∧ gate(q) ∧ (committed prefix = y*_<b)
    L_KL  =  Σ_r w_r Σ_j m^PG_rj KL_rj                      k3(p, r) = r/p − log(r/p) − 1 on o, or the exact KL

`log π` are log-probabilities under the *tempered* distribution softmax(ℓ/τ_k) at the recorded state. PG and SD (and
KL) read the same logits: one forward with gradient per state. Advantages, gates, masks, weights, π_old and π_ref are
inputs and never differentiated. Zero-std groups get Â = 0 exactly, so they contribute no PG gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "efficiency_reward", "exact_kl", "group_advantages", "k3", "pair_weights", "pg_loss", "rollout_advantages",
    "sd_loss", "sdrl_terms", "token_logprobs", "total_loss",
]


def group_advantages(rewards: jax.Array, eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """Â = (R − mean_g R) / (std_g R + eps) per group; rewards [Q, G]. Returns (Â [Q, G], zero_std [Q] bool).

    Groups whose rewards are all equal get Â = 0 exactly (not (R − mean)/eps, which rounding could make non-zero).
    """
    r = jnp.asarray(rewards, jnp.float32)
    mean = jnp.mean(r, axis=1, keepdims=True)
    std = jnp.std(r, axis=1, keepdims=True)
    zero_std = jnp.all(r == r[:, :1], axis=1)
    adv = jnp.where(zero_std[:, None], 0.0, (r - mean) / (std + eps))
    return adv, zero_std


def rollout_advantages(rewards, prompt_index, num_prompts: int, eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """Per-rollout Â of one iteration: rewards [R] of the rollout rows, `prompt_index` [R] the prompt of each row (the
    rollout's `prompt_index`, any row order). Each prompt's G rows form one group of `group_advantages`, found by its
    index rather than by a reshape, so no row order can mix prompts. Returns (Â [R], zero_std [num_prompts] bool)."""
    r = np.asarray(rewards, np.float32).reshape(-1)
    q = np.asarray(prompt_index).reshape(-1)
    if r.shape != q.shape:
        raise ValueError(f"rollout_advantages: {r.shape[0]} rewards but {q.shape[0]} prompt indices")
    counts = np.bincount(q, minlength=num_prompts) if q.size else np.zeros(num_prompts, int)
    if q.size and (q.min() < 0 or q.max() >= num_prompts):
        raise ValueError(f"rollout_advantages: prompt indices must lie in [0, {num_prompts}), got {q.min()}..{q.max()}")
    if len(set(counts.tolist())) != 1:
        raise ValueError(f"rollout_advantages: every prompt needs the same number of rollouts, got {counts.tolist()}")
    order = np.argsort(q, kind="stable")  # rows of prompt 0, then prompt 1, ...: [num_prompts, G] after the reshape
    adv_grouped, zero_std = group_advantages(jnp.asarray(r[order].reshape(num_prompts, -1)), eps)
    adv = jnp.zeros(r.shape, jnp.float32).at[jnp.asarray(order)].set(adv_grouped.reshape(-1))
    return adv, zero_std


def efficiency_reward(reward: jax.Array, steps: jax.Array, max_steps, eta: float,
                      reward_max: float = 1.0) -> jax.Array:
    """R' = R (1 + η (1 − steps / K_max)) on full-credit outputs (R ≥ R_max = `sdrl.reward_max`); others unchanged
    (docs/sdrl.md §2). Partial credit gets no bonus: a fast half-right answer must not outrank a slow fully right one."""
    bonus = 1.0 + eta * (1.0 - jnp.asarray(steps, jnp.float32) / jnp.asarray(max_steps, jnp.float32))
    return jnp.where(reward >= reward_max, reward * bonus, reward)


def _f32(x: jax.Array) -> jax.Array:
    """At least fp32 (bf16 logits are promoted; fp64 in x64 tests stays fp64)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[tokens] in (at least) fp32; logits [..., V] (already divided by τ), tokens [...]."""
    logp = jax.nn.log_softmax(_f32(logits), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def k3(logp: jax.Array, logp_ref: jax.Array) -> jax.Array:
    """k3(p, r) = r/p − log(r/p) − 1 ≥ 0 from log-probabilities (Schulman's unbiased, low-variance KL estimator)."""
    d = logp_ref - logp
    return jnp.exp(d) - d - 1.0


def exact_kl(logits: jax.Array, ref_logits: jax.Array) -> jax.Array:
    """KL(π_θ ‖ π_ref) per position over the full vocabulary; both [..., V] tempered logits."""
    logp = jax.nn.log_softmax(_f32(logits), axis=-1)
    logr = jax.nn.log_softmax(_f32(ref_logits), axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - logr), axis=-1)


def pair_weights(mask: jax.Array | np.ndarray, rollout: jax.Array | np.ndarray, num_rollouts: int) -> jax.Array:
    """w_r = 1 / (R · n_i) for row r of rollout i (n_i = Σ mask over the rollout's rows); 0 for rows of empty rollouts.

    mask [N, L] bool (the used positions of each state row), rollout [N] int in [0, R). Returns [N] fp32.
    """
    per_row = jnp.sum(mask.astype(jnp.float32), axis=-1)
    n = jax.ops.segment_sum(per_row, rollout, num_segments=num_rollouts)
    n_row = n[rollout]
    return jnp.where(n_row > 0, 1.0 / (num_rollouts * jnp.maximum(n_row, 1.0)), 0.0)


def _row_sum(x: jax.Array, mask: jax.Array, weight: jax.Array) -> jax.Array:
    return jnp.sum(weight * jnp.sum(jnp.where(mask, x, 0.0), axis=-1))


def pg_loss(logp: jax.Array, logp_old: jax.Array, adv: jax.Array, mask: jax.Array, weight: jax.Array,
            clip_eps: float) -> tuple[jax.Array, jax.Array]:
    """PPO clipped surrogate; logp/logp_old/mask [N, L], adv/weight [N]. Returns (L_PG, clip fraction).

    The clip fraction is the share of used pairs whose ratio lies outside [1 − ε, 1 + ε] on the side where the clip
    removes the gradient (the pairs PPO actually clips).
    """
    ratio = jnp.exp(logp - jax.lax.stop_gradient(logp_old))
    a = adv[:, None]
    unclipped = ratio * a
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * a
    loss = -_row_sum(jnp.minimum(unclipped, clipped), mask, weight)
    active = mask & (clipped < unclipped)
    frac = jnp.sum(active) / jnp.maximum(jnp.sum(mask), 1)
    return loss, frac.astype(jnp.float32)


def sd_loss(logp_target: jax.Array, mask: jax.Array, weight: jax.Array, omega: jax.Array | None = None) -> jax.Array:
    """Σ_r w_r ω_r Σ_j mask (−log π_θ(y*_j)); `mask` already holds the gate and the prefix check."""
    w = weight if omega is None else weight * omega
    return _row_sum(-logp_target, mask, w)


def sdrl_terms(logp_o: jax.Array, logp_y: jax.Array, batch: dict, *, clip_eps: float,
               kl: jax.Array | None = None) -> dict[str, jax.Array]:
    """L_PG, L_SD, L_KL and diagnostics from the student's tempered log-probabilities at the recorded states.

    logp_o, logp_y [N, L]: log π_θ(o_j) and log π_θ(y*_j), read from the SAME forward (one per state).
    `batch` keys ([N, L] unless noted): `pg_mask`, `sd_mask` (bool), `logp_old`, `logp_ref` (fp32; `logp_ref` only
    for the k3 KL), `advantage` [N], `weight` [N], optional `omega` [N]. `kl` [N, L]: a precomputed per-position KL
    (the exact one, `exact_kl`); None: k3 on the output tokens.
    """
    pg_mask, sd_mask, w = batch["pg_mask"], batch["sd_mask"], batch["weight"]
    l_pg, clip_frac = pg_loss(logp_o, batch["logp_old"], batch["advantage"], pg_mask, w, clip_eps)
    l_sd = sd_loss(logp_y, sd_mask, w, batch.get("omega"))
    if kl is None:
        kl = k3(logp_o, jax.lax.stop_gradient(batch["logp_ref"]))
    l_kl = _row_sum(kl, pg_mask, w)
    ratio = jnp.exp(logp_o - batch["logp_old"])
    n = jnp.maximum(jnp.sum(pg_mask), 1)
    return {"loss_pg": l_pg, "loss_sd": l_sd, "loss_kl": l_kl, "clip_fraction": clip_frac,
            "ratio_mean": jnp.sum(jnp.where(pg_mask, ratio, 0.0)) / n,
            "sd_pairs": jnp.sum(sd_mask).astype(jnp.float32), "pg_pairs": jnp.sum(pg_mask).astype(jnp.float32)}


def total_loss(terms: dict[str, jax.Array], weights, anchor: jax.Array | float = 0.0,
               retention: jax.Array | float = 0.0) -> jax.Array:
    """(4.2): `weights` has `.pg .sd .kl .anchor` (e.g. `SDRLConfig.weights()`) and optionally `.retention`; a zero
    weight drops its term entirely (so a NaN in a switched-off term cannot leak into the loss)."""
    total = jnp.zeros((), jnp.float32)
    for w, x in ((weights.pg, terms["loss_pg"]), (weights.sd, terms["loss_sd"]), (weights.kl, terms["loss_kl"]),
                 (weights.anchor, anchor), (getattr(weights, "retention", 0.0), retention)):
        if w:
            total = total + w * x
    return total
