"""Fixed-capacity KV cache with position-based visibility.

Slot s of every layer holds the key/value of absolute position s (positions are shared by the batch: left pads
consume positions, as transformers' `generate` does, and are marked invalid). `length` = N, the number of positions
encoded so far. Visibility is never implied by what the buffer happens to hold; it comes from masks built on
positions (`dgemma.model.masks`), which is what makes the decoder's "last W-1 cached tokens" rule on sliding layers
exact and independent of the buffer layout:

    encoder query at p, sliding layer : slots s with p - W < s <= p          (window of W including itself)
    decoder (canvas) query, sliding   : slots s with N - (W-1) <= s < N      (what HF's DynamicCache keeps)
    full layers                       : every valid slot s < N (and s <= p for the encoder)

Only the encoder writes the cache; the decoder reads it and never modifies it. The cache is a plain pytree so it can
be carried through `jax.lax.while_loop`, jitted, sharded (batch, kv_heads) and donated.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    keys: tuple[jax.Array, ...]  # per layer [B, C, KV_l, D_l]
    values: tuple[jax.Array, ...]  # per layer [B, C, KV_l, D_l]
    valid: jax.Array  # [B, C] bool: slot holds a real (non-pad) token
    length: jax.Array  # [] int32: N, positions written so far

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @classmethod
    def init(cls, cfg, batch_size: int, capacity: int, dtype=None) -> "KVCache":
        dtype = jnp.dtype(dtype or cfg.dtype)
        shapes = [(batch_size, capacity, cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
                  for i in range(cfg.num_hidden_layers)]
        return cls(
            keys=tuple(jnp.zeros(s, dtype) for s in shapes),
            values=tuple(jnp.zeros(s, dtype) for s in shapes),
            valid=jnp.zeros((batch_size, capacity), bool),
            length=jnp.zeros((), jnp.int32),
        )

    def write(self, layer_kv: list[tuple[jax.Array, jax.Array]], valid: jax.Array) -> "KVCache":
        """Append T new positions (the encoder's k/v per layer, and their validity [B, T]) at slot `length`."""
        start = self.length
        keys = tuple(jax.lax.dynamic_update_slice_in_dim(c, k.astype(c.dtype), start, axis=1)
                     for c, (k, _) in zip(self.keys, layer_kv))
        values = tuple(jax.lax.dynamic_update_slice_in_dim(c, v.astype(c.dtype), start, axis=1)
                       for c, (_, v) in zip(self.values, layer_kv))
        new_valid = jax.lax.dynamic_update_slice_in_dim(self.valid, valid, start, axis=1)
        return KVCache(keys, values, new_valid, start + valid.shape[1])

    def truncate(self, length) -> "KVCache":
        """Forget positions >= length (e.g. to re-encode a block). Buffers are kept; visibility is by mask."""
        slots = jnp.arange(self.capacity)
        return dataclasses.replace(self, valid=self.valid & (slots < length)[None, :],
                                   length=jnp.asarray(length, jnp.int32))
