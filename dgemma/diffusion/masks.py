"""One-pass block-diffusion training mask over [clean stream ; noisy stream] (docs/stage1.md §4).

Layout (docs/stage1.md §4)
--------------------------
One training row holds a clean stream (prompt + clean response, causal, identical to the AR model) followed by a noisy
stream (x_t of the response). The noisy-stream token of response position j has the **same** position id as its clean
twin, so both see the same RoPE phase. Block ids: −1 prompt, b ≥ 0 response block (canvas) b, −2 padding/unused.

    index  0 … P+R−1        : clean  tokens, pos = positions[i], blk = block_id[i]
    index  P+R … P+2R−1     : noisy  tokens, pos = positions[P + j], blk = block_id[P + j]

Attention rule allow(q, k) (docs/stage1.md §4), True = q may attend to k
------------------------------------------------------------------------
    clean → clean : pos(k) ≤ pos(q)                      [sliding layers: and pos(k) > pos(q) − W]
    clean → noisy : never
    noisy → clean : blk(k) < blk(q)  (STRICT; prompt −1 always qualifies)
                    [sliding layers: hf_fixed       pos(k) ≥ s_b − (W − 1), s_b = first position of q's block
                                     jax_per_query  pos(k) > pos(q) − W]
    noisy → noisy : blk(k) = blk(q)  (bidirectional inside the canvas, no window)
    always        : k is valid (not padding) and segment(k) = segment(q)

Example, P = 2 prompt tokens, L = 2, two blocks, full-attention layer (■ = allowed):

                    clean keys            noisy keys
                    p0 p1 c0 c1 c2 c3     n0 n1 n2 n3
           blk      -1 -1  0  0  1  1      0  0  1  1
    clean  p0 -1     ■  .  .  .  .  .      .  .  .  .
           p1 -1     ■  ■  .  .  .  .      .  .  .  .
           c0  0     ■  ■  ■  .  .  .      .  .  .  .
           c1  0     ■  ■  ■  ■  .  .      .  .  .  .
           c2  1     ■  ■  ■  ■  ■  .      .  .  .  .
           c3  1     ■  ■  ■  ■  ■  ■      .  .  .  .
    noisy  n0  0     ■  ■  .  .  .  .      ■  ■  .  .
           n1  0     ■  ■  .  .  .  .      ■  ■  .  .
           n2  1     ■  ■  ■  ■  .  .      .  .  ■  ■
           n3  1     ■  ■  ■  ■  .  .      .  .  ■  ■

Why each rule:
* Strictness: with blk(k) ≤ blk(q), canvas b sees its own clean answer (the c-keys of its block) and the CE collapses
  to 0. ``strict=False`` exists only so a test can show the leak is detected.
* W − 1: at inference the HF decoder for block b sees, on sliding layers, exactly the last W − 1 cached tokens,
  positions [s_b − (W − 1), s_b), the same for every canvas query. ``pos(k) ≥ s_b − W`` would be off by one; a
  per-query band is Google's JAX sampler (``jax_per_query``), which agrees with HF only while the context is ≤ W − L.
* Clean attention is token-causal so the clean stream (and its KV) equals the AR model; ``block_causal`` (BD3-LM's
  M_BC: bidirectional inside each response block, prompt still causal) is an ablation.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dgemma.model.attention_mask import NO_LOWER, interval_mask

__all__ = [
    "TokenInfo",
    "Streams",
    "block_starts",
    "block_diffusion_mask",
    "block_diffusion_intervals",
    "concat_streams",
]

BLK_PROMPT = -1
BLK_PAD = -2

LayerTypeArg = Literal["sliding_attention", "full_attention", "sliding", "full"]
DecoderSliding = Literal["hf_fixed", "jax_per_query"]
CleanAttention = Literal["causal", "block_causal"]


class TokenInfo(NamedTuple):
    """Per-token index arrays, all [B, T].

    Attributes:
      pos: int position ids (RoPE positions; absolute, pads included, per segment when packed).
      blk: int block ids: −1 prompt, b ≥ 0 response block, −2 padding/unused.
      is_noisy: bool, True for the noisy (canvas) stream.
      valid: bool, False for padding.
      segment: optional int packing segment ids.
      block_start: optional int s_b, the first position of the token's block; derived with :func:`block_starts` if
        None (requires blocks to be contiguous runs of the stream, which :func:`concat_streams` guarantees).
    """

    pos: jax.Array | np.ndarray  # numpy in the static pattern (`block_diffusion_mask(..., xp=numpy)`)
    blk: jax.Array | np.ndarray
    is_noisy: jax.Array | np.ndarray
    valid: jax.Array | np.ndarray
    segment: jax.Array | np.ndarray | None = None
    block_start: jax.Array | np.ndarray | None = None


class Streams(NamedTuple):
    """Output of :func:`concat_streams`: arrays of length P + 2R along axis 1."""

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    block_id: jax.Array
    is_noisy: jax.Array
    segment: jax.Array | None
    block_start: jax.Array

    @property
    def info(self) -> TokenInfo:
        """The :class:`TokenInfo` to pass as both ``q_info`` and ``k_info`` of :func:`block_diffusion_mask`."""
        return TokenInfo(self.positions, self.block_id, self.is_noisy, self.valid, self.segment, self.block_start)


def block_starts(
    pos: jax.Array | np.ndarray, blk: jax.Array | np.ndarray, is_noisy: jax.Array | np.ndarray,
    segment: jax.Array | np.ndarray | None = None,
) -> jax.Array:
    """s_b per token: the position of the first token of the contiguous run sharing (blk, stream, segment).

    Args:
      pos, blk, is_noisy, segment: [B, T] as in :class:`TokenInfo`.

    Returns:
      [B, T] int, pos of the run's first token (O(T), via a cumulative max of run-start indices).
    """
    b, t = blk.shape
    change = (blk[:, 1:] != blk[:, :-1]) | (is_noisy[:, 1:] != is_noisy[:, :-1])
    if segment is not None:
        change = change | (segment[:, 1:] != segment[:, :-1])
    new_run = jnp.concatenate([jnp.ones((b, 1), bool), change], axis=1)
    idx = jax.lax.broadcasted_iota(jnp.int32, (b, t), 1)
    first = jax.lax.cummax(jnp.where(new_run, idx, 0), axis=1)
    return jnp.take_along_axis(pos, first, axis=1)


def _is_sliding(layer_type: str) -> bool:
    if layer_type in ("sliding_attention", "sliding"):
        return True
    if layer_type in ("full_attention", "full"):
        return False
    raise ValueError(f"unknown layer_type {layer_type!r}")


def _checked_rule(window, layer_type, decoder_sliding, clean_attention) -> int | None:
    """Validate the attention rule's options (for the dense and the interval form); the window W of a sliding layer
    (>= 1), None for a full one."""
    if decoder_sliding not in ("hf_fixed", "jax_per_query"):
        raise ValueError(f"unknown decoder_sliding {decoder_sliding!r}")
    if clean_attention not in ("causal", "block_causal"):
        raise ValueError(f"unknown clean_attention {clean_attention!r}")
    sliding = _is_sliding(layer_type)
    if sliding and (window is None or window < 1):
        raise ValueError("sliding layers need window >= 1")
    return window if sliding else None


def block_diffusion_mask(
    q_info: TokenInfo,
    k_info: TokenInfo,
    *,
    window: int | None,
    layer_type: LayerTypeArg,
    decoder_sliding: DecoderSliding = "hf_fixed",
    clean_attention: CleanAttention = "causal",
    strict: bool = True,
    xp=jnp,
) -> jax.Array:
    """The one-pass attention mask as a dense boolean [B, Tq, Tk] (True = may attend).

    Args:
      q_info: query tokens (usually ``streams.info``; may be a sub-range of it if ``block_start`` is set).
      k_info: key tokens.
      window: sliding window W (used only when ``layer_type`` is sliding; required then).
      layer_type: "sliding_attention" / "sliding" or "full_attention" / "full".
      decoder_sliding: "hf_fixed" (noisy query of block b sees clean keys pos ≥ s_b − (W − 1); HF/default) or
        "jax_per_query" (pos(k) > pos(q) − W; Google's JAX sampler).
      clean_attention: "causal" (AR-exact, default) or "block_causal" (prompt causal, response blocks bidirectional).
      strict: noisy → clean requires blk(k) < blk(q). False (≤) leaks the answer; for negative tests only.
      xp: the array module; ``numpy`` (with numpy ``TokenInfo`` arrays and ``block_start`` given) builds a static
        pattern at trace time without touching a device (the Splash kernel's mask).

    Returns:
      bool [B, Tq, Tk]. Rows of padding queries may be all False; the attention kernel must tolerate that.
    """
    sliding_window = _checked_rule(window, layer_type, decoder_sliding, clean_attention)

    qp, kp = q_info.pos[:, :, None], k_info.pos[:, None, :]
    qb, kb = q_info.blk[:, :, None], k_info.blk[:, None, :]
    qn, kn = q_info.is_noisy[:, :, None], k_info.is_noisy[:, None, :]

    allowed_base = k_info.valid[:, None, :]
    if q_info.segment is not None or k_info.segment is not None:
        if q_info.segment is None or k_info.segment is None:
            raise ValueError("segment ids must be given for both queries and keys")
        allowed_base = allowed_base & (q_info.segment[:, :, None] == k_info.segment[:, None, :])

    # clean -> clean
    causal = kp <= qp
    if clean_attention == "block_causal":
        in_response_block = (kb == qb) & (qb >= 0)
        causal = (causal & (qb < 0)) | ((kb < qb) & (kb >= BLK_PROMPT)) | in_response_block
    clean_clean = causal
    if sliding_window is not None:
        clean_clean = clean_clean & (kp > qp - sliding_window)

    # noisy -> clean
    earlier = (kb < qb) if strict else (kb <= qb)
    noisy_clean = earlier & (kb >= BLK_PROMPT)
    if sliding_window is not None:
        if decoder_sliding == "hf_fixed":
            s_q = q_info.block_start
            if s_q is None:
                s_q = block_starts(q_info.pos, q_info.blk, q_info.is_noisy, q_info.segment)
            noisy_clean = noisy_clean & (kp >= s_q[:, :, None] - (sliding_window - 1))
        else:
            noisy_clean = noisy_clean & (kp > qp - sliding_window)

    # noisy -> noisy
    noisy_noisy = (kb == qb) & (qb >= 0)

    rule = xp.where(qn, xp.where(kn, noisy_noisy, noisy_clean), xp.where(kn, False, clean_clean))
    return allowed_base & rule


# Noisy keys get the coordinate BLOCK_TAG * (blk + 3) + pos: blocks never share a coordinate range with each other
# or with the clean keys (coordinate = pos < BLOCK_TAG), so "same block" is one interval.
BLOCK_TAG = 2 ** 20


def block_ends(pos: jax.Array | np.ndarray, blk: jax.Array | np.ndarray, is_noisy: jax.Array | np.ndarray) -> jax.Array:
    """1 + the position of the last token of each token's contiguous (blk, stream) run, [B, T]."""
    last = block_starts(pos[:, ::-1], blk[:, ::-1], is_noisy[:, ::-1])[:, ::-1]
    return last + 1


def block_diffusion_intervals(info: TokenInfo, *, window: int | None, layer_type: LayerTypeArg,
                              decoder_sliding: DecoderSliding = "hf_fixed", clean_attention: CleanAttention = "causal",
                              strict: bool = True):
    """The rule of :func:`block_diffusion_mask` (queries = keys = the streams) as an `IntervalMask`.

    Key coordinates: pos for clean keys, ``BLOCK_TAG * (blk + 3) + pos`` for noisy keys. Per query:
      clean     : interval 1 = [pos - W + 1 (sliding) , pos + 1)   (block_causal, response query: up to its block end)
      noisy, b>=0: interval 1 = clean keys before its block: [s_b - (W - 1) | pos - W + 1 | -inf, s_b);
                  interval 2 = every noisy key of block b.
      noisy, b<0 : nothing (the dense rule allows nothing either).
    Equal to the dense rule on every valid query when blocks are ordered by position (blk(k) < blk(q) <=> pos(k) <
    s_b for valid clean keys), which the layout guarantees; packed segments and ``strict=False`` are dense-only.
    """
    if info.segment is not None:
        raise ValueError("model.execution.attention_impl chunked / tokamax: packed segment ids are not supported by "
                         "the one-pass interval mask; use attention_impl=dense")
    if not strict:
        raise ValueError("model.execution.attention_impl chunked / tokamax: strict=False (the leaky negative-control "
                         "mask) is dense-only")
    sliding_window = _checked_rule(window, layer_type, decoder_sliding, clean_attention)
    pos, blk, noisy = info.pos.astype(jnp.int32), info.blk.astype(jnp.int32), info.is_noisy
    s_b = info.block_start if info.block_start is not None else block_starts(pos, blk, noisy)
    s_b = s_b.astype(jnp.int32)
    coord = jnp.where(noisy, BLOCK_TAG * (blk + 3) + pos, pos)

    # clean queries
    c_lo = pos - sliding_window + 1 if sliding_window is not None else jnp.full_like(pos, NO_LOWER)
    c_hi = pos + 1
    if clean_attention == "block_causal":
        c_hi = jnp.where(blk >= 0, block_ends(pos, blk, noisy), c_hi)
    # noisy queries
    if sliding_window is None:
        n_lo: jax.Array | np.ndarray = jnp.full_like(pos, NO_LOWER)
    elif decoder_sliding == "hf_fixed":
        n_lo = s_b - (sliding_window - 1)
    else:
        n_lo = pos - sliding_window + 1
    in_block = noisy & (blk >= 0)
    zero = jnp.zeros_like(pos)
    lo1 = jnp.where(noisy, jnp.where(in_block, n_lo, zero), c_lo)
    hi1 = jnp.where(noisy, jnp.where(in_block, s_b, zero), c_hi)
    lo2 = jnp.where(in_block, BLOCK_TAG * (blk + 3), zero)
    hi2 = jnp.where(in_block, BLOCK_TAG * (blk + 4), zero)
    return interval_mask(coord, info.valid, lo1, hi1, lo2, hi2)


def concat_streams(
    tokens_clean: jax.Array,
    x_t: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    block_id: jax.Array,
    segment: jax.Array | None = None,
) -> Streams:
    """Build the [clean ; noisy] training row (the layout above) from the training layout (`dgemma.data.layout`).

    Args:
      tokens_clean: [B, P+R] prompt (possibly left-padded) followed by the clean response region of R = N_b·L tokens.
      x_t: [B, R] noisy canvas tokens for the response region (see ``corruption.corrupt``).
      positions: [B, P+R] position ids of the clean row (absolute; left pads consume positions, as in HF generate).
      valid: [B, P+R] bool, False for padding.
      block_id: [B, P+R] int: −1 prompt, b ≥ 0 canvas block, −2 padding/unused.
      segment: optional [B, P+R] packing segment ids (copied to the noisy twins).

    Returns:
      :class:`Streams` with arrays of length P + 2R. The noisy-stream token of response position j is x_t[j], the same
      position and block id as clean index P + j, and is valid iff the clean twin is valid and in a block (id ≥ 0).
    """
    r = x_t.shape[1]
    if tokens_clean.shape[1] < r:
        raise ValueError("x_t is longer than the clean row")
    resp = slice(tokens_clean.shape[1] - r, None)
    noisy_blk = block_id[:, resp]
    noisy_valid = valid[:, resp] & (noisy_blk >= 0)

    cat = lambda a, b: jnp.concatenate([a, b], axis=1)  # noqa: E731
    tokens = cat(tokens_clean, x_t.astype(tokens_clean.dtype))
    pos = cat(positions, positions[:, resp])
    val = cat(valid, noisy_valid)
    blk = cat(block_id, noisy_blk)
    is_noisy = cat(jnp.zeros(tokens_clean.shape, bool), jnp.ones(x_t.shape, bool))
    seg = None if segment is None else cat(segment, segment[:, resp])
    starts = block_starts(pos, blk, is_noisy, seg)
    return Streams(tokens, pos, val, blk, is_noisy, seg, starts)
