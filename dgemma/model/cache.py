"""KV cache: full-length slots for full-attention layers, a ring of slots for sliding-window layers.

Positions are shared by the batch (left pads consume positions, as transformers' `generate` does, and are marked
invalid). `length` = N, the number of positions encoded so far; `valid` [B, C] says which of the C = capacity
positions hold real tokens.

Full-attention layers keep C slots: slot s holds position s. Sliding layers keep S = min(C, W - 1 + L) slots (W the
window, L the canvas length) used as a ring: position p lives in slot p mod S, so slot s holds position
p(s) = N - 1 - ((N - 1 - s) mod S) (none if p(s) < 0). That is the last S positions, which covers everything a
sliding layer may read -- W - 1 cached tokens for an encoder query or a canvas (HF's DynamicSlidingWindowLayer keeps
W - 1) -- plus one canvas of slack so that `truncate` can take back one canvas of L tokens exactly (re-encoding a
block). Sliding-layer memory is O(W + L) instead of O(C). When C <= S the ring is exactly the linear layout.

Visibility is never implied by what the buffer happens to hold; it comes from masks built on slot positions
(`dgemma.model.masks`), which keep the decoder's "last W-1 cached tokens" rule exact whatever the layout:

    encoder query at p, sliding layer : slots with p - W < p(s) <= p          (window of W including itself)
    decoder (canvas) query, sliding   : slots with N - (W-1) <= p(s) < N      (what HF's DynamicCache keeps)
    full layers                       : every valid slot s < N (and s <= p for the encoder)

Only the encoder writes the cache; the decoder reads it and never modifies it. The cache is a plain pytree so it can
be carried through `jax.lax.while_loop`, jitted, sharded (batch, kv_heads) and donated.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig


def default_sliding_slots(cfg: ModelConfig, capacity: int) -> int:
    """Ring size of the sliding layers: the window's W - 1 tokens plus one canvas, at most the capacity."""
    return min(capacity, cfg.sliding_window - 1 + cfg.canvas_length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    keys: tuple[jax.Array, ...]  # per layer [B, slots_l, KV_l, D_l]: slots_l = C (full) or the ring size (sliding)
    values: tuple[jax.Array, ...]  # per layer [B, slots_l, KV_l, D_l]
    valid: jax.Array  # [B, C] bool: position holds a real (non-pad) token
    length: jax.Array  # [] int32: N, positions written so far

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @classmethod
    def init(cls, cfg: ModelConfig, batch_size: int, capacity: int, dtype=None, *, sliding_slots: int | None = None) -> "KVCache":
        """Empty cache for `capacity` positions; sliding layers get `sliding_slots` ring slots (default: see module)."""
        dtype = jnp.dtype(dtype or cfg.execution.dtype)
        ring = default_sliding_slots(cfg, capacity) if sliding_slots is None else min(int(sliding_slots), capacity)
        if ring < min(capacity, cfg.sliding_window - 1):
            raise ValueError(f"KVCache.init: sliding_slots={sliding_slots} is below the W - 1 = "
                             f"{cfg.sliding_window - 1} cached tokens a sliding layer reads")
        # KV-shared layers (dgemma.model.kv_sharing) read their producer's slots and keep none of their own
        shapes = [(batch_size, 0 if cfg.kv_producer(i) is not None else ring if cfg.is_sliding(i) else capacity,
                   cfg.layer_kv_heads(i), cfg.layer_head_dim(i)) for i in range(cfg.num_hidden_layers)]
        return cls(
            keys=tuple(jnp.zeros(s, dtype) for s in shapes),
            values=tuple(jnp.zeros(s, dtype) for s in shapes),
            valid=jnp.zeros((batch_size, capacity), bool),
            length=jnp.zeros((), jnp.int32),
        )

    def slots_of(self, cfg: ModelConfig, layer_type: str) -> int:
        """Slot count of the layers of `layer_type` (the capacity if the model has no such layer)."""
        for i, t in enumerate(cfg.layer_types):
            if t == layer_type and cfg.kv_producer(i) is None:
                return self.keys[i].shape[1]
        return self.capacity

    def slot_positions(self, slots: int) -> tuple[jax.Array, jax.Array]:
        """(positions [slots] int32, visible [B, slots] bool) of a layer with `slots` slots at the current length.

        Linear layers (slots == C) give position s for slot s; rings the last `slots` positions. `visible` is False
        for slots that hold nothing yet (p < 0 or p >= N) or a padding token.
        """
        n = self.length.astype(jnp.int32)
        s = jnp.arange(slots, dtype=jnp.int32)
        pos = n - 1 - jnp.mod(n - 1 - s, slots)
        ok = (pos >= 0) & (pos < n)
        tok_valid = jnp.take(self.valid, jnp.clip(pos, 0, self.capacity - 1), axis=1)
        return pos, tok_valid & ok[None, :]

    def write(self, layer_kv: list[tuple[jax.Array, jax.Array]], valid: jax.Array) -> "KVCache":
        """Append T new positions (the encoder's k/v per layer, and their validity [B, T]) at position `length`."""
        start = self.length
        T = valid.shape[1]

        def put(c, x):
            S = c.shape[1]
            if S == 0:  # a KV-shared layer: nothing of its own to keep (its new K/V is None)
                return c
            x = x.astype(c.dtype)
            if S == self.capacity:
                return jax.lax.dynamic_update_slice_in_dim(c, x, start, axis=1)
            m = min(T, S)  # only the last S new positions survive in a ring of S slots
            idx = jnp.mod(start + T - m + jnp.arange(m, dtype=jnp.int32), S)
            return c.at[:, idx].set(x[:, T - m:], unique_indices=True)

        layer_kv = [(None, None) if kv is None else kv for kv in layer_kv]
        keys = tuple(put(c, k) for c, (k, _) in zip(self.keys, layer_kv))
        values = tuple(put(c, v) for c, (_, v) in zip(self.values, layer_kv))
        new_valid = jax.lax.dynamic_update_slice_in_dim(self.valid, valid, start, axis=1)
        return KVCache(keys, values, new_valid, start + T)

    def truncate(self, length) -> "KVCache":
        """Forget positions >= length (e.g. to re-encode a block). Buffers are kept; visibility is by mask.

        A sliding ring of S slots still holds every position a later query may read (length - (W - 1) onwards) iff
        N - length <= S - (W - 1); with the default ring that is one canvas (the caller's contract). When the lengths
        are concrete, going back S or more positions (the last kept position is then certainly overwritten) raises.
        """
        rings = [k.shape[1] for k in self.keys if 0 < k.shape[1] < self.capacity]
        if rings:
            try:
                back = int(np.asarray(self.length)) - int(np.asarray(length))
            except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
                back = None
            if back is not None and back >= min(rings):
                raise ValueError(f"KVCache.truncate: going back {back} positions overwrote positions a sliding ring "
                                 f"of {min(rings)} slots must keep; build the cache with "
                                 f"KVCache.init(..., sliding_slots=W - 1 + {back})")
        slots = jnp.arange(self.capacity)
        return dataclasses.replace(self, valid=self.valid & (slots < length)[None, :],
                                   length=jnp.asarray(length, jnp.int32))
