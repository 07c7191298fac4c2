"""Per-step pieces of the block sampler: temperature schedule, token entropy, accept rules, stop test.

All functions are pure, jit-friendly and work on one batch of canvases ([B, L] / [B, L, V]). They follow
transformers' DiffusionGemma sampler (`generation_diffusion_gemma.py`) operation by operation, so that fed the same
logits and draws they make the same decisions (docs/sampler.md §1-§3):

    τ(step) = t_min + (t_max − t_min) · step / K_max,   step = K_max, K_max−1, …, 1
                                                                     (LinearTemperatureScheduleLogitsProcessor)
    H_j     = −Σ_v p_v log p_v  of softmax(ℓ_j / τ), fp32                       (torch Categorical(logits).entropy())
    accept  = rank r of the ascending sort of H is accepted iff cumsum(H_sorted)_r − H_(r) ≤ γ
                                                                              (EntropyBoundSampler.accept_canvas)
    stop    = (S == 0 or argmax equals each of the last S argmaxes) and mean_j H_j < c (strict)
                                                                              (StableAndConfidentStoppingCriteria)

Sorting: JAX's argsort is stable, torch.sort is not; the two can differ only for exactly equal entropies that
straddle the bound (ties at H = 0, the common case for confident tokens, are all accepted either way).

Variants (docs/sampler.md §2): `confidence_accept` (Fast-dLLM: p(chosen) ≥ threshold, at least one) and
`fixed_count_accept` (the k lowest-entropy positions, as in LLaDA / d1).

`eb_step` is THE per-step decision of the sampler (accept, renoise, freeze, stop), composed from the pieces above;
`eb_denoise_step` adds the temperature and the randomness (proposal and renoise draws) to it: everything one step does
after the model call, shared by the sampler's loop and the exported step artifact. `needs_fallback` is the per-block
AR-fallback decision of "auto" mode.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "argmax",
    "sample_categorical",
    "temperature",
    "temperature_schedule",
    "token_entropy",
    "entropy_bound_accept",
    "confidence_accept",
    "fixed_count_accept",
    "stability_update",
    "StepDecision",
    "eb_step",
    "eb_denoise_step",
    "needs_fallback",
]


def temperature(step_index, max_steps: int, t_min, t_delta) -> jax.Array:
    """τ at loop iteration `step_index` (0-based; HF's `cur_step` = max_steps − step_index), in fp32.

    Mirrors torch: `cur_step / max_steps` is an fp32 true division of int32 by int, then `t_min + t_delta * r` in fp32
    with t_delta = float32(t_max − t_min) (the difference taken in Python double, as HF does). First iteration: t_max;
    last: t_min + t_delta / K_max.
    """
    cur = jnp.asarray(max_steps - step_index, jnp.int32)
    r = cur.astype(jnp.float32) / jnp.float32(max_steps)
    return jnp.asarray(t_min, jnp.float32) + jnp.asarray(t_delta, jnp.float32) * r


def temperature_schedule(max_steps: int, t_min: float, t_max: float) -> np.ndarray:
    """All K_max temperatures in loop order (host helper for reports and tests)."""
    d = np.float32(t_max - t_min)
    return np.asarray([temperature(i, max_steps, np.float32(t_min), d) for i in range(max_steps)], np.float32)


def token_entropy(z: jax.Array) -> jax.Array:
    """Entropy (nats, fp32) of softmax(z) over the last axis, computed as torch's Categorical does.

    logp = z − logsumexp(z); p = softmax(logp); H = −Σ logp·p (logp clamped at the fp32 minimum, so −inf logits
    contribute 0 instead of NaN).
    """
    z = z.astype(jnp.float32)
    logp = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
    p = jax.nn.softmax(logp, axis=-1)
    logp = jnp.maximum(logp, jnp.finfo(jnp.float32).min)
    return -jnp.sum(logp * p, axis=-1)


def argmax(z: jax.Array) -> jax.Array:
    """First index of the maximum over the last axis (= jnp.argmax for non-NaN input), int32.

    Two plain reductions (max, then min over matching indices) instead of XLA's variadic argmax reduce, which is
    ~7x slower on CPU at [2, 64, 4096]; vocab-sharded it is a max and a min all-reduce.
    """
    m = jnp.max(z, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    return jnp.min(jnp.where(z == m, iota, z.shape[-1] - 1), axis=-1)


def sample_categorical(keys: jax.Array, z: jax.Array, method: str = "inverse_cdf") -> jax.Array:
    """One draw from softmax(z) per position; z [B, L, V], keys [B] (row b uses only keys[b]). int32 [B, L].

    "inverse_cdf": u ~ U(0, 1] per position, token = first index whose cumulative probability reaches u times the
      total mass (one uniform per position instead of V; zero-probability tokens are never drawn).
    "gumbel": `jax.random.categorical` (Gumbel-max over V; shard-local under a vocab-sharded head).
    Both are exact samplers; they consume different random bits, so they give different (equally valid) draws.
    """
    L, V = z.shape[-2], z.shape[-1]
    if method == "gumbel":
        return jax.vmap(lambda k, zr: jax.random.categorical(k, zr, axis=-1))(keys, z).astype(jnp.int32)
    if method != "inverse_cdf":
        raise ValueError(f"unknown sampling method {method!r}")
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (L, 1), jnp.float32))(keys)  # (0, 1]
    c = jnp.cumsum(jax.nn.softmax(z.astype(jnp.float32), axis=-1), axis=-1)
    idx = jnp.sum((c < u * c[..., -1:]).astype(jnp.int32), axis=-1)
    return jnp.minimum(idx, V - 1)


def _scatter_sorted(mask_sorted: jax.Array, order: jax.Array) -> jax.Array:
    """Inverse of `take_along_axis(x, order)`: put the sorted-order mask back at the original positions."""
    B = order.shape[0]
    rows = jnp.arange(B)[:, None]
    return jnp.zeros(mask_sorted.shape, bool).at[rows, order].set(mask_sorted)


def entropy_bound_accept(entropy: jax.Array, gamma, order: jax.Array | None = None) -> jax.Array:
    """EB-sampler accept mask [B, L]: the largest set of lowest-entropy positions with ΣH − max H ≤ γ.

    Computed exactly as HF: sort ascending, `cumsum(sorted) − sorted ≤ γ`, scatter back. The lowest-entropy position
    is always accepted (0 ≤ γ for γ ≥ 0). `order` (optional [B, L] permutation) replaces the argsort, to replay
    another implementation's tie order.
    """
    if order is None:
        order = jnp.argsort(entropy, axis=-1, stable=True)
    s = jnp.take_along_axis(entropy, order, axis=-1)
    sel = (jnp.cumsum(s, axis=-1) - s) <= jnp.asarray(gamma, s.dtype)
    return _scatter_sorted(sel, order)


def confidence_accept(z: jax.Array, chosen: jax.Array, threshold) -> jax.Array:
    """Accept positions whose chosen token has probability ≥ threshold under softmax(z); at least the most
    confident position per row (Fast-dLLM `get_transfer_index`)."""
    logp = jax.nn.log_softmax(z.astype(jnp.float32), axis=-1)
    p = jnp.exp(jnp.take_along_axis(logp, chosen[..., None].astype(jnp.int32), axis=-1)[..., 0])
    best = jax.nn.one_hot(jnp.argmax(p, axis=-1), p.shape[-1], dtype=bool)
    return (p >= jnp.asarray(threshold, p.dtype)) | best


def fixed_count_accept(entropy: jax.Array, count: int) -> jax.Array:
    """Accept the `count` lowest-entropy positions per row (stable order; at least 1)."""
    L = entropy.shape[-1]
    order = jnp.argsort(entropy, axis=-1, stable=True)
    sel = jnp.broadcast_to(jnp.arange(L)[None] < max(1, min(count, L)), entropy.shape)
    return _scatter_sorted(sel, order)


def stability_update(history: jax.Array, argmax: jax.Array, threshold: int) -> tuple[jax.Array, jax.Array]:
    """HF's stability test and history push. history [S, B, L] (init −1), argmax [B, L] -> (stable [B], history).

    stable = the argmax equals every stored one (S = 0: always stable); then the oldest entry is dropped and the
    new argmax appended.
    """
    if threshold == 0:
        return jnp.ones(argmax.shape[:1], bool), history
    stable = jnp.all(history == argmax[None], axis=(0, 2))
    history = jnp.concatenate([history[1:], argmax[None].astype(history.dtype)], axis=0)
    return stable, history


class StepDecision(NamedTuple):
    """What one denoising step decided, per row. [B, L] unless noted."""

    argmax: jax.Array  # argmax of z (before freezing)
    draft: jax.Array  # the row's current output: argmax, or the previous draft for rows already done
    accept: jax.Array  # accept set (bool)
    canvas: jax.Array  # next canvas: proposal on accept, renoise elsewhere; unchanged for rows already done
    entropy: jax.Array  # tempered token entropies
    mean_entropy: jax.Array  # [B]
    done: jax.Array  # [B] the stop rule has fired (now or earlier)
    history: jax.Array  # [max(S, 1), B, L] argmax history after this step


def eb_step(z, proposal, noise, canvas, prev_draft, done, history, *, accept_rule: str, gamma, accept_confidence,
            fixed_count: int, stability: int, confidence_threshold, order=None) -> StepDecision:
    """The entropy-bounded sampler's decisions at one step, from the tempered logits z [B, L, V] (HF order).

    a = argmax z; H = entropy(softmax z); A = accept rule (EB: ΣH − max H ≤ γ over the lowest entropies);
    canvas' = proposal on A, `noise` elsewhere; rows already `done` are frozen (canvas and draft unchanged, as HF
    keeps their argmax and logits); done' = done | (draft equals the last S drafts, or S = 0) & mean H < c.
    """
    a = argmax(z)
    ent = token_entropy(z)
    if accept_rule == "entropy_bound":
        accept = entropy_bound_accept(ent, gamma, order=order)
    elif accept_rule == "confidence":
        accept = confidence_accept(z, proposal, accept_confidence)
    elif accept_rule == "fixed_count":
        accept = fixed_count_accept(ent, fixed_count)
    else:
        raise ValueError(f"unknown accept rule {accept_rule!r}")
    frozen = done[:, None]
    draft = jnp.where(frozen, prev_draft, a)
    new_canvas = jnp.where(frozen, canvas, jnp.where(accept, proposal, noise))
    mean_h = jnp.mean(ent, axis=-1)
    stable, history = stability_update(history, draft, stability)
    new_done = done | (stable & (mean_h < confidence_threshold))
    return StepDecision(a, draft, accept, new_canvas, ent, mean_h, new_done, history)


def eb_denoise_step(logits, step_keys, step_index, canvas, prev_draft, done, history, dyn, *, vocab_size: int,
                    max_steps: int, accept_rule: str, greedy: bool, sampling: str, stability: int, draws=None):
    """One step of the EB block sampler after the model call: τ at this step, tempered logits z = logits / τ, the
    proposal (argmax when `greedy`, else a draw from softmax z with the row's step key), the renoise draw, and
    `eb_step`. The sampler's loop (`dgemma.inference.sampler`) and the exported step artifact
    (`dgemma.convert.artifact.denoise_step`) both run exactly this.

    logits [B, L, V] fp32; step_keys [B] (the row keys of this step: each row's block key folded with step + 1);
    dyn: the runtime scalars (`SamplerConfig.dynamic_part()`); draws: replayed randomness (`InjectedDraws`) or None.
    Returns (τ, z, proposal [B, L] int32, StepDecision).
    """
    L = logits.shape[-2]
    tau = temperature(step_index, max_steps, dyn["t_min"], dyn["t_delta"])
    z = logits / tau
    ks = jax.vmap(jax.random.split)(step_keys)  # [B, 2]: proposal key, renoise key
    if greedy:
        proposal = argmax(z)
    elif draws is not None:
        proposal = draws["samples"][step_index]
    else:
        proposal = sample_categorical(ks[:, 0], z, sampling)
    if draws is not None:
        noise = draws["noise"][step_index].astype(jnp.int32)
    else:
        noise = jax.vmap(lambda k: jax.random.randint(k, (L,), 0, vocab_size, jnp.int32))(ks[:, 1])
    order = draws["order"][step_index] if draws is not None and "order" in draws else None
    proposal = proposal.astype(jnp.int32)
    dec = eb_step(z, proposal, noise, canvas, prev_draft, done, history, accept_rule=accept_rule,
                  gamma=dyn["entropy_bound"], accept_confidence=dyn["accept_confidence"],
                  fixed_count=math.ceil(L / max_steps), stability=stability,
                  confidence_threshold=dyn["confidence_threshold"], order=order)
    return tau, z, proposal, dec


def needs_fallback(done: jax.Array, last_mean_entropy: jax.Array, threshold) -> jax.Array:
    """"auto" mode: a block falls back to AR when its stop rule never fired and (threshold ≤ 0, or its last mean
    entropy exceeds the threshold)."""
    return ~done & ((threshold <= 0) | (last_mean_entropy > threshold))
