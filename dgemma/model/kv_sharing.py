"""KV sharing of the small Gemma 4 models (E2B, E4B), exactly as transformers' `kv_sharing_modes`.

With `num_kv_shared_layers = n`, the last n layers compute no keys or values: layer i >= L - n attends with its own
queries to the keys and values of its producer `cfg.kv_producer(i)`, the last layer of the same type before L - n
(transformers' "store" layer). What the producer stores is its *whole* key sequence of the call: the cached keys
(the prefix) followed by the keys of the new tokens, so a shared layer sees exactly the producer's keys under the
mask of its own layer type (the producer has the same type, hence the same mask).

In dgemma every mode runs through one stack walk (`Transformer.forward`), so the rule holds for the AR forward, the
encoder writing the cache, the canvas decoder reading it and the one-pass training layouts alike: a shared layer's
"prefix" is its producer's prefix (a cache or a clean stream's keys), its new keys are the producer's new keys.
Shared layers own no K/V parameters (no k_proj, v_proj, k_norm) and no cache slots (`KVCache` keeps 0 slots for
them); their entry in the per-layer K/V list `forward` returns is None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig


def shared_keys_values(producer_kv, producer_prefix=None) -> tuple[jax.Array, jax.Array]:
    """The (keys, values) a shared layer attends to: [producer's prefix ; producer's new K/V] along positions."""
    k, v = producer_kv
    if producer_prefix is None:
        return k, v
    pk, pv = producer_prefix
    return jnp.concatenate([pk.astype(k.dtype), k], axis=1), jnp.concatenate([pv.astype(v.dtype), v], axis=1)


def cache_layers(cfg: ModelConfig) -> tuple[bool, ...]:
    """Per layer: whether it owns cache slots (False for KV-shared layers)."""
    return tuple(cfg.kv_producer(i) is None for i in range(cfg.num_hidden_layers))


__all__ = ["cache_layers", "shared_keys_values"]
