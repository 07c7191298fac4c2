"""Attention masks for the inference modes (boolean [B, Tq, Tk], True = may attend).

The one-pass *training* mask over [clean ; noisy] streams lives in `dgemma.diffusion.masks`; the masks here are the
three inference-time patterns and are built from absolute positions only:

    causal (AR / encoder)      k <= q, and on sliding layers q - W < k        (W keys including the query itself)
    decoder (canvas denoiser)  cache slot s < N visible (sliding: s >= N - (W - 1), exactly the W - 1 tokens
                               HF's DynamicCache keeps); every canvas key visible (bidirectional, no window)

Keys of a cached call are laid out as [cache slots 0..C-1 ; new tokens], matching `Attention(prefix=...)`.
"""

from __future__ import annotations

import jax.numpy as jnp

from dgemma.model.config import FULL, SLIDING


def causal_mask(q_pos, k_pos, k_valid, window: int | None):
    """q_pos [B, Tq], k_pos [B, Tk], k_valid [B, Tk] -> [B, Tq, Tk]."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    allowed = (k <= q) & k_valid[:, None, :]
    if window is not None:
        allowed &= k > q - window
    return allowed


def full_forward_masks(cfg, positions, valid):
    """No cache: plain causal masks for a whole sequence (AR forward, encoder-only training)."""
    return {
        SLIDING: causal_mask(positions, positions, valid, cfg.sliding_window),
        FULL: causal_mask(positions, positions, valid, None),
    }


def encoder_masks(cfg, cache, positions, valid):
    """Encoder chunk at `positions` [B, T] reading the cache and itself causally."""
    B = positions.shape[0]
    slots = jnp.broadcast_to(jnp.arange(cache.capacity, dtype=positions.dtype)[None], (B, cache.capacity))
    slot_valid = cache.valid & (slots < cache.length)
    k_pos = jnp.concatenate([slots, positions], axis=1)
    k_valid = jnp.concatenate([slot_valid, valid], axis=1)
    return {
        SLIDING: causal_mask(positions, k_pos, k_valid, cfg.sliding_window),
        FULL: causal_mask(positions, k_pos, k_valid, None),
    }


def decoder_masks(cfg, cache, positions, canvas_valid):
    """Canvas queries at `positions` [B, L]: bidirectional over the canvas, read-only over the cache."""
    B, L = positions.shape
    N = cache.length
    slots = jnp.arange(cache.capacity)[None, None, :]
    cached = (cache.valid[:, None, :] & (slots < N))  # [B, 1, C]
    if cfg.decoder_sliding == "hf_fixed":
        # Every canvas query sees the same last W-1 cached tokens (HF DynamicSlidingWindowLayer keeps W-1).
        sliding_cached = cached & (slots >= N - (cfg.sliding_window - 1))
    else:  # "jax_per_query": Google's JAX sampler applies a per-query window k > q - W as well.
        sliding_cached = cached & (slots > positions[:, :, None] - cfg.sliding_window)
    canvas = jnp.broadcast_to(canvas_valid[:, None, :], (B, L, L))
    return {
        SLIDING: jnp.concatenate([jnp.broadcast_to(sliding_cached, (B, L, cache.capacity)), canvas], axis=2),
        FULL: jnp.concatenate([jnp.broadcast_to(cached, (B, L, cache.capacity)), canvas], axis=2),
    }
