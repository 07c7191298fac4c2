"""Autoregressive decoding on the same weights (the AR model, and DiffusionGemma's AR fallback).

The prompt is prefilled with the causal encoder pass (writing the KV cache); then one token per step is encoded at
the next position. The whole decode loop is one `jax.lax.while_loop` inside one jitted function: no host round trip
per token. Rows stop at their first EOS (later positions become PAD); the loop ends when every row is done.

Batching: prompts are LEFT-padded to a common length with `prompt_valid=False` on pads. Positions are absolute and
shared by the batch (pads consume positions, as HF `generate` does for DiffusionGemma); RoPE attention depends only
on position differences, so a padded row decodes the same tokens as the row alone (up to fp rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dgemma.model.cache import KVCache


def sample_token(logits: jax.Array, key: jax.Array, temperature: float | jax.Array) -> jax.Array:
    """Greedy when temperature == 0, else a categorical draw from softmax(logits / T) (fp32)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if isinstance(temperature, (int, float)) and temperature == 0:
        return greedy
    t = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    sampled = jax.random.categorical(key, logits / t, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.asarray(temperature) > 0, sampled, greedy)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "capacity", "temperature", "eos_ids",
                                             "pad_id"))
def _generate(graphdef, state, prompt, prompt_valid, key, *, max_new_tokens, capacity, temperature, eos_ids, pad_id):
    model = nnx.merge(graphdef, state)
    B, P = prompt.shape
    cache = KVCache.init(model.cfg, B, capacity)
    hidden, cache = model.encode(prompt, cache, prompt_valid)
    last_logits = model.logits(hidden[:, -1:])[:, 0]
    eos = jnp.asarray(eos_ids, jnp.int32)
    out = jnp.full((B, max_new_tokens), pad_id, jnp.int32)

    def cond(carry):
        i, _, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, cache, logits, out, done, key = carry
        key, sub = jax.random.split(key)
        tok = sample_token(logits, sub, temperature)
        tok = jnp.where(done, pad_id, tok)
        out = jax.lax.dynamic_update_slice_in_dim(out, tok[:, None], i, axis=1)
        done = done | jnp.isin(tok, eos)
        hidden, cache = model.encode(tok[:, None], cache)
        return i + 1, cache, model.logits(hidden)[:, 0], out, done, key

    init = (jnp.int32(0), cache, last_logits, out, jnp.zeros((B,), bool), key)
    _, _, _, out, done, _ = jax.lax.while_loop(cond, body, init)
    return out, done


def generate(model, prompt, prompt_valid=None, *, max_new_tokens: int, temperature: float = 0.0, key=None,
             eos_ids=None, pad_id: int | None = None) -> jax.Array:
    """Decode up to `max_new_tokens` per row. Returns [B, max_new_tokens] int32 (PAD after the first EOS)."""
    prompt = jnp.asarray(prompt, jnp.int32)
    prompt_valid = jnp.ones(prompt.shape, bool) if prompt_valid is None else jnp.asarray(prompt_valid, bool)
    cfg = model.cfg
    eos_ids = tuple(cfg.eos_token_id if eos_ids is None else eos_ids)
    pad_id = cfg.pad_token_id if pad_id is None else pad_id
    graphdef, state = nnx.split(model)
    key = jax.random.key(0) if key is None else key
    out, _ = _generate(graphdef, state, prompt, prompt_valid, key, max_new_tokens=max_new_tokens,
                       capacity=prompt.shape[1] + max_new_tokens, temperature=float(temperature), eos_ids=eos_ids,
                       pad_id=pad_id)
    return out
