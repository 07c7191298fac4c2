"""Portable flash-style attention in pure JAX over a structured mask (`IntervalMask`); never a [T, S] array.

    out = chunked_attention(q, k, v, mask, q_chunk=512, kv_chunk=512)   # q [B,T,KV,G,D], k/v [B,S,KV,D]

Forward: queries are processed in chunks of `q_chunk` (`lax.map`); for each, an online softmax (running max, sum
and weighted values, Rabe-Staats / FlashAttention) runs over the KV chunks of at most two contiguous ranges of KV
chunks, which are the only tiles the mask's intervals can reach (computed from the mask's bounding boxes: a KV chunk
is visited iff some key coordinate in it can fall in some query's interval). Fully masked tiles (the clean response
region for noisy queries, everything outside the sliding window, padding-only chunks) are never computed, so a
sliding layer costs O(T * W) and the one-pass layout about half of the dense work.

Backward: a custom VJP of the same memory order (FlashAttention-2): the forward saves only the output and the
per-row log-sum-exp; the backward recomputes each visited tile's probabilities and accumulates dq per query chunk
and dk / dv into [S]-sized buffers. Live memory is O(q_chunk * kv_chunk) per head plus O(T + S) buffers.

Rows with no visible key give output 0 (the dense path gives the mean of all values there); such rows are padding
queries whose outputs are never read by a valid token.

Scores are q . k * scale, accumulated in fp32; probabilities are cast to the value dtype for the PV product.
Sequences that are not a multiple of the chunk sizes are padded here (keys as invalid, queries with empty
intervals); the layout builders refuse training layouts that would need padding (`check_chunking`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dgemma.model.attention_mask import IntervalMask

_BIG = 2 ** 30
F32 = jnp.float32


def check_chunking(T: int, S: int, q_chunk: int, kv_chunk: int, what: str) -> None:
    """One-line error when a static layout's length is not a multiple of a chunk size longer than... the chunk."""
    for name, n, c in (("model.execution.attention_q_chunk", T, q_chunk),
                       ("model.execution.attention_kv_chunk", S, kv_chunk)):
        if n > c and n % c:
            raise ValueError(f"{name}={c} does not divide the {what} length {n}; choose a divisor of {n} "
                             f"(or a chunk >= {n})")


def tile_ranges(mask: IntervalMask, q_chunk: int, kv_chunk: int) -> jax.Array:
    """[nq, 4] int32: per query chunk, two disjoint KV-chunk ranges [a1, b1) and [a2, b2) covering every KV chunk the
    mask can allow (a superset: the rule is still applied per element inside each visited tile)."""
    B, T = mask.lo1.shape
    S = mask.key_coord.shape[1]
    nq, nk = T // q_chunk, S // kv_chunk
    coord = mask.key_coord.reshape(B, nk, kv_chunk)
    valid = mask.key_valid.reshape(B, nk, kv_chunk)
    kmin = jnp.min(jnp.where(valid, coord, _BIG), axis=(0, 2))  # chunks without a valid key are never visited
    kmax = jnp.max(jnp.where(valid, coord, -_BIG), axis=(0, 2))

    def span(lo, hi):
        lo, hi = lo.reshape(B, nq, q_chunk), hi.reshape(B, nq, q_chunk)
        nonempty = lo < hi
        qlo = jnp.min(jnp.where(nonempty, lo, _BIG), axis=(0, 2))
        qhi = jnp.max(jnp.where(nonempty, hi, -_BIG), axis=(0, 2))
        need = (kmin[None, :] < qhi[:, None]) & (kmax[None, :] >= qlo[:, None])  # [nq, nk]
        anyn = need.any(axis=1)
        a = jnp.where(anyn, jnp.argmax(need, axis=1), 0)
        b = jnp.where(anyn, nk - jnp.argmax(need[:, ::-1], axis=1), 0)
        return a, b

    a1, b1 = span(mask.lo1, mask.hi1)
    a2, b2 = span(mask.lo2, mask.hi2)
    e1, e2 = b1 > a1, b2 > a2
    overlap = e1 & e2 & (a1 < b2) & (a2 < b1)  # merge, so that no tile is visited twice
    a1n = jnp.where(overlap, jnp.minimum(a1, a2), jnp.where(e1, a1, a2))
    b1n = jnp.where(overlap, jnp.maximum(b1, b2), jnp.where(e1, b1, b2))
    a2n = jnp.where(overlap | ~e1, 0, a2)
    b2n = jnp.where(overlap | ~e1, 0, b2)
    return jnp.stack([a1n, b1n, a2n, b2n], axis=1).astype(jnp.int32)


def _tile(qi, k, v, mask_arrays, iv, c, kv_chunk, scale):
    """Scores [B,KV,G,qc,kc] (fp32), allowed [B,1,1,qc,kc], and the tile's keys/values."""
    coord, valid = mask_arrays
    start = c * kv_chunk
    kj = lax.dynamic_slice_in_dim(k, start, kv_chunk, 1)
    vj = lax.dynamic_slice_in_dim(v, start, kv_chunk, 1)
    cj = lax.dynamic_slice_in_dim(coord, start, kv_chunk, 1)[:, None, :]
    okj = lax.dynamic_slice_in_dim(valid, start, kv_chunk, 1)[:, None, :]
    lo1, hi1, lo2, hi2 = (a[..., None] for a in iv)
    allowed = okj & (((cj >= lo1) & (cj < hi1)) | ((cj >= lo2) & (cj < hi2)))
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=F32) * scale
    return s, allowed[:, None, None], kj, vj


def _chunk_of(j, r):
    """KV chunk index of the j-th visited tile for ranges r = (a1, b1, a2, b2)."""
    n1 = r[1] - r[0]
    return jnp.where(j < n1, r[0] + j, r[2] + j - n1)


def _forward(q, k, v, coord, valid, lo1, hi1, lo2, hi2, ranges, q_chunk, kv_chunk, scale):
    B, T, KV, G, D = q.shape
    nq = T // q_chunk

    def one(i):
        qs = i * q_chunk
        qi = lax.dynamic_slice_in_dim(q, qs, q_chunk, 1)
        iv = [lax.dynamic_slice_in_dim(a, qs, q_chunk, 1) for a in (lo1, hi1, lo2, hi2)]
        r = ranges[i]

        def body(j, carry):
            m, l, acc = carry
            s, allowed, _, vj = _tile(qi, k, v, (coord, valid), iv, _chunk_of(j, r), kv_chunk, scale)
            s = jnp.where(allowed, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(m - m_safe)
            l = l * corr + p.sum(-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vj, preferred_element_type=F32)
            return m_new, l, acc * corr[..., None] + pv

        init = (jnp.full((B, KV, G, q_chunk), -jnp.inf, F32), jnp.zeros((B, KV, G, q_chunk), F32),
                jnp.zeros((B, KV, G, q_chunk, D), F32))
        m, l, acc = lax.fori_loop(0, (r[1] - r[0]) + (r[3] - r[2]), body, init)
        out = acc / jnp.where(l > 0, l, 1.0)[..., None]
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        return out.astype(q.dtype), lse

    out, lse = lax.map(one, jnp.arange(nq))  # [nq, B, KV, G, qc, D], [nq, B, KV, G, qc]
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(B, T, KV, G, D), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12))
def _flash(q, k, v, coord, valid, lo1, hi1, lo2, hi2, ranges, q_chunk, kv_chunk, scale):
    return _forward(q, k, v, coord, valid, lo1, hi1, lo2, hi2, ranges, q_chunk, kv_chunk, scale)[0]


def _flash_fwd(q, k, v, coord, valid, lo1, hi1, lo2, hi2, ranges, q_chunk, kv_chunk, scale):
    out, lse = _forward(q, k, v, coord, valid, lo1, hi1, lo2, hi2, ranges, q_chunk, kv_chunk, scale)
    return out, (q, k, v, coord, valid, lo1, hi1, lo2, hi2, ranges, out, lse)


def _flash_bwd(q_chunk, kv_chunk, scale, res, dout):
    q, k, v, coord, valid, lo1, hi1, lo2, hi2, ranges, out, lse = res
    B, T, KV, G, D = q.shape
    S = k.shape[1]
    delta = jnp.sum(dout.astype(F32) * out.astype(F32), axis=-1)  # [B, T, KV, G]

    def outer(carry, xs):
        dk, dv = carry
        i, lse_i = xs
        qs = i * q_chunk
        qi = lax.dynamic_slice_in_dim(q, qs, q_chunk, 1)
        doi = lax.dynamic_slice_in_dim(dout, qs, q_chunk, 1)
        delta_i = lax.dynamic_slice_in_dim(delta, qs, q_chunk, 1).transpose(0, 2, 3, 1)  # [B, KV, G, qc]
        iv = [lax.dynamic_slice_in_dim(a, qs, q_chunk, 1) for a in (lo1, hi1, lo2, hi2)]
        lse_safe = jnp.where(jnp.isfinite(lse_i), lse_i, 0.0)
        r = ranges[i]

        def body(j, c2):
            dq_i, dk, dv = c2
            c = _chunk_of(j, r)
            s, allowed, kj, vj = _tile(qi, k, v, (coord, valid), iv, c, kv_chunk, scale)
            p = jnp.where(allowed, jnp.exp(s - lse_safe[..., None]), 0.0)
            dv_c = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dout.dtype), doi, preferred_element_type=F32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=F32)
            ds = p * (dp - delta_i[..., None]) * scale
            dq_i = dq_i + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), kj, preferred_element_type=F32)
            dk_c = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), qi, preferred_element_type=F32)
            start = c * kv_chunk
            dk = lax.dynamic_update_slice_in_dim(dk, lax.dynamic_slice_in_dim(dk, start, kv_chunk, 1) + dk_c, start, 1)
            dv = lax.dynamic_update_slice_in_dim(dv, lax.dynamic_slice_in_dim(dv, start, kv_chunk, 1) + dv_c, start, 1)
            return dq_i, dk, dv

        init = (jnp.zeros((B, q_chunk, KV, G, D), F32), dk, dv)
        dq_i, dk, dv = lax.fori_loop(0, (r[1] - r[0]) + (r[3] - r[2]), body, init)
        return (dk, dv), dq_i

    zeros = jnp.zeros((B, S, KV, D), F32)
    nq = T // q_chunk
    (dk, dv), dq = lax.scan(outer, (zeros, zeros), (jnp.arange(nq), lse))
    dq = dq.transpose(1, 0, 2, 3, 4, 5).reshape(B, T, KV, G, D)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)) + (None,) * 7


_flash.defvjp(_flash_fwd, _flash_bwd)


def chunked_attention(q, k, v, mask: IntervalMask, *, q_chunk: int, kv_chunk: int, scale: float = 1.0) -> jax.Array:
    """q [B, T, KV, G, D] (query head n = kv head n // G), k / v [B, S, KV, D] -> [B, T, KV, G, D]."""
    B, T = q.shape[:2]
    S = k.shape[1]
    if mask.shape != (T, S):
        raise ValueError(f"IntervalMask covers (queries, keys) = {mask.shape} but attention has {(T, S)}")
    qc, kc = min(q_chunk, T), min(kv_chunk, S)
    pad_t, pad_s = (-T) % qc, (-S) % kc
    coord, valid = mask.key_coord, mask.key_valid
    lo1, hi1, lo2, hi2 = mask.lo1, mask.hi1, mask.lo2, mask.hi2
    if pad_t:  # padded queries have empty intervals
        q = jnp.pad(q, ((0, 0), (0, pad_t), (0, 0), (0, 0), (0, 0)))
        lo1, hi1, lo2, hi2 = (jnp.pad(a, ((0, 0), (0, pad_t))) for a in (lo1, hi1, lo2, hi2))
    if pad_s:  # padded keys are invalid
        k = jnp.pad(k, ((0, 0), (0, pad_s), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad_s), (0, 0), (0, 0)))
        coord = jnp.pad(coord, ((0, 0), (0, pad_s)))
        valid = jnp.pad(valid, ((0, 0), (0, pad_s)))
    padded = IntervalMask(coord, valid, lo1, hi1, lo2, hi2)
    ranges = lax.stop_gradient(tile_ranges(padded, qc, kc))
    out = _flash(q, k, v, coord, valid, lo1, hi1, lo2, hi2, ranges, qc, kc, float(scale))
    return out[:, :T]


__all__ = ["chunked_attention", "check_chunking", "tile_ranges"]
