"""Attention masks given as STRUCTURE (per-query key intervals), never as a [T, S] array.

Every mask dgemma uses -- causal, sliding window, the decoder's W - 1 rule over the cache, the one-pass
[clean ; noisy] block-diffusion rule, left padding -- has the form

    allowed(b, q, k) = key_valid[b, k] and (lo1[b, q] <= coord[b, k] < hi1[b, q]  or  lo2[b, q] <= coord[b, k] < hi2[b, q])

with an integer coordinate per key (usually its position). Interval 1 is the causal / windowed / clean-prefix part,
interval 2 the canvas a decoder query sees bidirectionally. `IntervalMask` holds exactly these arrays, so its memory
is O(T + S); the chunked kernel (`dgemma.model.attention_chunked`) evaluates the rule per [q_chunk, kv_chunk] tile and
skips tiles the intervals exclude. `to_dense` materialises the same rule for tests and for comparison with the dense
masks of `dgemma.model.masks` / `dgemma.diffusion.masks`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Lower bound meaning "no lower limit" (coordinates are >= 0 positions or block-tagged positions, all >= 0).
NO_LOWER = -(2 ** 30)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IntervalMask:
    """Structured attention mask; all arrays int32 except `key_valid` (bool). Shapes broadcast over the batch."""

    key_coord: jax.Array  # [B, S] int32
    key_valid: jax.Array  # [B, S] bool
    lo1: jax.Array  # [B, T] int32, interval 1 = [lo1, hi1)
    hi1: jax.Array
    lo2: jax.Array  # [B, T] int32, interval 2 = [lo2, hi2) (empty: lo2 = hi2 = 0)
    hi2: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        """(T, S): query and key counts."""
        return self.lo1.shape[-1], self.key_coord.shape[-1]

    def allowed(self, q_slice=slice(None), k_slice=slice(None)) -> jax.Array:
        """The boolean rule for a sub-block: [B, Tq, Sk]."""
        c = self.key_coord[:, None, k_slice]
        in1 = (c >= self.lo1[:, q_slice, None]) & (c < self.hi1[:, q_slice, None])
        in2 = (c >= self.lo2[:, q_slice, None]) & (c < self.hi2[:, q_slice, None])
        return self.key_valid[:, None, k_slice] & (in1 | in2)

    def to_dense(self) -> jax.Array:
        """[B, T, S] bool (tests / the dense reference only: this is the O(T*S) array the structure avoids)."""
        return self.allowed()

    def restrict(self, rows: slice, cols: slice) -> "IntervalMask":
        """The rule for a sub-range of the queries and keys (e.g. one stream of the one-pass layout)."""
        return IntervalMask(self.key_coord[:, cols], self.key_valid[:, cols], self.lo1[:, rows], self.hi1[:, rows],
                            self.lo2[:, rows], self.hi2[:, rows])

    def concat_keys(self, other_coord: jax.Array, other_valid: jax.Array) -> "IntervalMask":
        """Append keys (e.g. [cache slots ; new tokens])."""
        return dataclasses.replace(self, key_coord=jnp.concatenate([self.key_coord, other_coord], axis=1),
                                   key_valid=jnp.concatenate([self.key_valid, other_valid], axis=1))


def interval_mask(key_coord, key_valid, lo1, hi1, lo2=None, hi2=None) -> IntervalMask:
    """Build an `IntervalMask`, broadcasting key arrays to [B, S] and query arrays to [B, T] (int32)."""
    key_valid = jnp.asarray(key_valid, bool)
    B = key_valid.shape[0]
    S = key_valid.shape[1]
    key_coord = jnp.broadcast_to(jnp.asarray(key_coord, jnp.int32), (B, S))
    lo1, hi1 = (jnp.asarray(a, jnp.int32) for a in (lo1, hi1))
    T = jnp.broadcast_shapes(lo1.shape, hi1.shape)[-1]
    q = lambda a: jnp.broadcast_to(jnp.asarray(a, jnp.int32), (B, T))  # noqa: E731
    if lo2 is None:
        lo2 = hi2 = jnp.zeros((B, T), jnp.int32)
    return IntervalMask(key_coord, key_valid, q(lo1), q(hi1), q(lo2), q(hi2))


__all__ = ["IntervalMask", "NO_LOWER", "interval_mask"]
