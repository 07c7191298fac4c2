"""Gemma 4 attention: GQA, q/k RMSNorm, weightless v norm, K=V on full layers, mask-driven visibility.

One module serves every mode. The caller passes
  * `prefix`: optional cached (keys, values) [B, C, KV, D] that the queries may read (encoder with cache, decoder),
  * `mask`: boolean [B, T, C + T] (or [B, T, T] without prefix): True where query t may attend to key s, or the
    same rule as structure (`IntervalMask`, built when `model.execution.attention_impl="chunked"`), which runs the
    pure-JAX flash path of `dgemma.model.attention_chunked` and never materialises the [T, S] scores, or a `SplashMask`
    (`model.execution.attention_impl="splash"`, one-pass training layout only): JAX's Pallas TPU Splash kernel
    (`dgemma.model.kernels`). With `model.execution.attention_impl="tokamax"` an `IntervalMask` goes to Tokamax's flash
    attention instead of the chunked path.
Keys are `concat(prefix, new)`. Whether keys are causal, windowed, bidirectional or block-structured is entirely the
mask's business (see `dgemma.model.masks` and `dgemma.diffusion.masks`), so the same weights and code give the AR
model, the DiffusionGemma encoder and decoder, and the one-pass training layout.

Per layer (as transformers' `Gemma4TextAttention`):
    q = RoPE(RMSNorm_D(x Wq; q_norm))
    k_raw = x Wk;  v_raw = x Wv (sliding)  or  k_raw (full layers, attention_k_eq_v: raw K, before norm and RoPE)
    (KV-shared layers: k, v are the producer's, `dgemma.model.kv_sharing`)
    k = RoPE(RMSNorm_D(k_raw; k_norm));  v = RMSNorm_noscale(v_raw)
    o = softmax_fp32(q k^T * 1.0 + mask) v Wo      (scaling is 1.0: q and k are RMS-normalised)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model.attention_chunked import chunked_attention
from dgemma.model.attention_mask import IntervalMask
from dgemma.model.kernels import SplashMask, splash_attention, tokamax_attention
from dgemma.model.layers import RMSNorm, apply_rope, param, rms_normalize, rope_inv_freq
from dgemma.model.lora_experts import adapt

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, param_dtype, rngs):
        H, N = cfg.hidden_size, cfg.num_attention_heads
        D, KV = cfg.layer_head_dim(layer), cfg.layer_kv_heads(layer)
        self.is_sliding = cfg.is_sliding(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = N, KV, D
        self.q_proj = param(rngs, (H, N, D), ("embed", "heads", "head_dim"), param_dtype)
        # KV-shared layers (dgemma.model.kv_sharing) read their producer's K/V: no k_proj, v_proj, k_norm
        shares_kv = cfg.kv_producer(layer) is not None
        self.k_proj = None if shares_kv else param(rngs, (H, KV, D), ("embed", "kv_heads", "head_dim"), param_dtype)
        # Full layers use K as V under attention_k_eq_v (always on in DiffusionGemma): no v_proj at all.
        has_v = cfg.layer_has_v_proj(layer) and not shares_kv
        self.v_proj = param(rngs, (H, KV, D), ("embed", "kv_heads", "head_dim"), param_dtype) if has_v else None
        self.o_proj = param(rngs, (N, D, H), ("heads", "head_dim", "embed"), param_dtype)
        self.q_norm = RMSNorm(D, eps=cfg.rms_norm_eps, dtype=param_dtype, axis_name="head_dim")
        self.k_norm = None if shares_kv else RMSNorm(D, eps=cfg.rms_norm_eps, dtype=param_dtype, axis_name="head_dim")
        self.eps = cfg.rms_norm_eps
        theta = cfg.rope_theta_sliding if self.is_sliding else cfg.rope_theta_full
        # Static (not a Variable): the RoPE table is a pure function of the config.
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(D, theta, cfg.rotary_dims(layer)))
        self.chunks = (cfg.execution.attention_q_chunk, cfg.execution.attention_kv_chunk)
        self.interpret = cfg.execution.kernel_interpret
        # Tokamax's implementation for structured masks, or None for the pure-JAX chunked path
        self.tokamax_backend = cfg.execution.tokamax_backend if cfg.execution.attention_impl == "tokamax" else None

    def project_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values exactly as they are cached: post-k_norm+RoPE keys, post-v_norm values."""
        dt = x.dtype
        # called only for a layer with its own K/V (`__call__`: k_proj set); k_norm is built with k_proj
        assert self.k_proj is not None and self.k_norm is not None
        k_raw = adapt(self, "k_proj", x, jnp.einsum("bth,hkd->btkd", x, self.k_proj[...].astype(dt)))
        v_raw = (adapt(self, "v_proj", x, jnp.einsum("bth,hkd->btkd", x, self.v_proj[...].astype(dt)))
                 if self.v_proj is not None else k_raw)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        k = apply_rope(self.k_norm(k_raw), positions, inv_freq)
        v = rms_normalize(v_raw, self.eps).astype(dt)
        return k, v

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array,
                 prefix: tuple[jax.Array, jax.Array] | None = None,
                 shared_kv: tuple[jax.Array, jax.Array] | None = None):
        """x [B, T, H]; positions [B, T]; mask [B, T, S]. Returns (out [B, T, H], (k_new, v_new)).

        A KV-shared layer gets `shared_kv` (its producer's whole keys and values, prefix included) and returns None
        for its own K/V."""
        dt = x.dtype
        B, T, _ = x.shape
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q = adapt(self, "q_proj", x, jnp.einsum("bth,hnd->btnd", x, self.q_proj[...].astype(dt)))
        q = apply_rope(self.q_norm(q), positions, inv_freq)
        k_new = v_new = None
        if self.k_proj is None:
            assert shared_kv is not None  # the Transformer passes a KV-shared layer its producer's K/V
            keys, values = (a.astype(dt) for a in shared_kv)
        else:
            k_new, v_new = self.project_kv(x, positions)
            keys, values = k_new, v_new
            if prefix is not None:
                keys = jnp.concatenate([prefix[0].astype(dt), k_new], axis=1)
                values = jnp.concatenate([prefix[1].astype(dt), v_new], axis=1)
        G = self.num_heads // self.num_kv_heads
        # Query head n uses kv head n // G (HF repeat_interleave): split N as (KV, G).
        qg = q.reshape(B, T, self.num_kv_heads, G, self.head_dim)
        if isinstance(mask, SplashMask):  # training layouts only: calls over a cache build IntervalMasks
            ctx = splash_attention(qg, keys, values, mask, block_q=self.chunks[0], block_kv=self.chunks[1],
                                   interpret=self.interpret)
        elif isinstance(mask, IntervalMask) and self.tokamax_backend is not None:
            ctx = tokamax_attention(qg, keys, values, mask, backend=self.tokamax_backend)
        elif isinstance(mask, IntervalMask):
            ctx = chunked_attention(qg, keys, values, mask, q_chunk=self.chunks[0], kv_chunk=self.chunks[1])
        else:
            scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys)
            scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(scores.dtype).min)
            probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dt)
            ctx = jnp.einsum("bkgts,bskd->btkgd", probs, values)
        ctx = ctx.reshape(B, T, self.num_heads, self.head_dim)
        out = adapt(self, "o_proj", ctx, jnp.einsum("btnd,ndh->bth", ctx, self.o_proj[...].astype(dt)))
        return out, (None if k_new is None else (k_new, v_new))
