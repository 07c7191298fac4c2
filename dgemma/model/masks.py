"""Attention masks for the inference modes, as dense boolean [B, Tq, Tk] arrays or as structure.

`model.execution.attention_impl` picks the form: "dense" builds the boolean arrays (True = may attend) that the
reference attention path reads; "chunked" and "tokamax" build the same rule as an `IntervalMask` (per-query key
intervals over key positions + per-key validity, `dgemma.model.attention_mask`), O(T + S) memory. The one-pass
*training* mask over [clean ; noisy] streams lives in `dgemma.diffusion.masks`; the masks here are the three
inference-time patterns, built from absolute positions only:

    causal (AR / encoder)      k <= q, and on sliding layers q - W < k        (W keys including the query itself)
    decoder (canvas denoiser)  cached position p < N visible (sliding: p >= N - (W - 1), exactly the W - 1 tokens
                               HF's DynamicCache keeps); every canvas key visible (bidirectional, no window)

Keys of a cached call are laid out as [cache slots ; new tokens], matching `Attention(prefix=...)`; the position of
a cache slot comes from `KVCache.slot_positions` (sliding layers keep a ring of slots, full layers one per position).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from dgemma.model.attention_chunked import check_chunking
from dgemma.model.attention_mask import NO_LOWER, interval_mask
from dgemma.model.config import FULL, SLIDING

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig


def causal_mask(q_pos, k_pos, key_valid, window: int | None):
    """q_pos [B, Tq], k_pos [B, Tk], key_valid [B, Tk] -> [B, Tq, Tk]."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    allowed = (k <= q) & key_valid[:, None, :]
    if window is not None:
        allowed &= k > q - window
    return allowed


def _causal_intervals(q_pos, k_pos, key_valid, window: int | None):
    """The `causal_mask` rule as an `IntervalMask`: keys with q - W < k <= q."""
    lo = NO_LOWER if window is None else q_pos - window + 1
    return interval_mask(k_pos, key_valid, jnp.broadcast_to(lo, q_pos.shape), q_pos + 1)


def _structured(cfg: ModelConfig) -> bool:
    return cfg.execution.attention_impl != "dense"


def full_forward_masks(cfg: ModelConfig, positions, valid):
    """No cache: plain causal masks for a whole sequence (AR forward, encoder-only training)."""
    if _structured(cfg):
        T = positions.shape[1]
        if cfg.execution.attention_impl == "chunked":  # Tokamax does not tile by these settings
            check_chunking(T, T, cfg.execution.attention_q_chunk, cfg.execution.attention_kv_chunk, "causal forward")
        return {SLIDING: _causal_intervals(positions, positions, valid, cfg.sliding_window),
                FULL: _causal_intervals(positions, positions, valid, None)}
    return {
        SLIDING: causal_mask(positions, positions, valid, cfg.sliding_window),
        FULL: causal_mask(positions, positions, valid, None),
    }


def _cache_keys(cfg: ModelConfig, cache, layer_type, B):
    """Positions [B, S] and visibility [B, S] of the cache slots of one layer type."""
    pos, ok = cache.slot_positions(cache.slots_of(cfg, layer_type))
    return jnp.broadcast_to(pos[None], (B, pos.shape[0])), ok


def encoder_masks(cfg: ModelConfig, cache, positions, valid):
    """Encoder chunk at `positions` [B, T] reading the cache and itself causally."""
    B = positions.shape[0]
    out = {}
    for layer_type, window in ((SLIDING, cfg.sliding_window), (FULL, None)):
        slot_pos, slot_ok = _cache_keys(cfg, cache, layer_type, B)
        k_pos = jnp.concatenate([slot_pos.astype(positions.dtype), positions], axis=1)
        key_valid = jnp.concatenate([slot_ok, valid], axis=1)
        build = _causal_intervals if _structured(cfg) else causal_mask
        out[layer_type] = build(positions, k_pos, key_valid, window)
    return out


def decoder_masks(cfg: ModelConfig, cache, positions, canvas_valid):
    """Canvas queries at `positions` [B, L]: bidirectional over the canvas, read-only over the cache."""
    B, L = positions.shape
    N = cache.length
    out: dict[str, Any] = {}  # an IntervalMask (structured paths) or a dense [B, L, S] mask per layer type
    for layer_type in (SLIDING, FULL):
        slot_pos, cached = _cache_keys(cfg, cache, layer_type, B)
        if layer_type == FULL:
            lo = jnp.full((B, L), NO_LOWER, jnp.int32)
        elif cfg.decoder_sliding == "hf_fixed":
            # Every canvas query sees the same last W-1 cached tokens (HF DynamicSlidingWindowLayer keeps W-1).
            lo = jnp.broadcast_to(N - (cfg.sliding_window - 1), (B, L))
        else:  # "jax_per_query": Google's JAX sampler applies a per-query window k > q - W as well.
            lo = positions - cfg.sliding_window + 1
        if _structured(cfg):
            # interval 1: cached positions [lo, N); interval 2: the canvas positions [N, N + L)
            k_pos = jnp.concatenate([slot_pos, positions], axis=1)
            out[layer_type] = interval_mask(k_pos, jnp.concatenate([cached, canvas_valid], axis=1), lo,
                                            jnp.broadcast_to(N, (B, L)), jnp.broadcast_to(N, (B, L)),
                                            jnp.broadcast_to(N + L, (B, L)))
            continue
        seen = cached[:, None, :] & (slot_pos[:, None, :] >= lo[:, :, None])  # [B, L, S]
        canvas = jnp.broadcast_to(canvas_valid[:, None, :], (B, L, L))
        out[layer_type] = jnp.concatenate([seen, canvas], axis=2)
    return out
