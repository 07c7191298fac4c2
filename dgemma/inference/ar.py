"""Autoregressive decoding on the same weights (the AR model, and DiffusionGemma's AR fallback): ONE decode loop.

The prompt is prefilled with the causal encoder pass (writing the KV cache); then one token per step is encoded at
the next position. `decode_loop` is the only AR loop of the package: `generate` runs it after a prefill, and the
block sampler's AR fallback (`dgemma.inference.sampler`) runs it for one canvas, teacher-forcing the committed tokens
of diffusion rows. One `jax.lax.while_loop` inside the caller's jit: no host round trip per token. Rows stop at their
first EOS (later positions become PAD).

Randomness (one rule for both users): row r's token at loop step j is drawn with fold_in(row_keys[r], key_offset + j)
from softmax(logits / T) (greedy when T == 0), so a row's draws do not depend on the rest of the batch.

Batching: prompts are LEFT-padded to a common length with `prompt_valid=False` on pads. Positions are absolute and
shared by the batch (pads consume positions, as HF `generate` does for DiffusionGemma); RoPE attention depends only
on position differences, so a padded row decodes the same tokens as the row alone (up to fp rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
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


def row_keys_of(key, batch: int, row_ids=None) -> jax.Array:
    """[B] per-row keys: `key` itself if it already is [B] keys, else fold_in(key, row_ids[r]) (ids default r)."""
    key = jax.random.key(0) if key is None else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if key.shape == (batch,):
        return key
    ids = np.arange(batch) if row_ids is None else np.asarray(row_ids)
    if ids.shape != (batch,):
        raise ValueError(f"row_ids must have shape ({batch},), got {ids.shape}")
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.asarray(ids, jnp.uint32))


def decode_loop(model, cache: KVCache, last_hidden, num_tokens: int, row_keys, temperature, eos, pad_id, *,
                key_offset=0, forced=None, ar_rows=None, finished=None, stop_when_done: bool = True):
    """Decode `num_tokens` positions; every step encodes one token per row into the cache.

    Args:
      last_hidden: [B, H] final hidden state of the last encoded position (its logits predict the first token).
      row_keys: [B] keys (see module docstring); key_offset: added to the step index in fold_in.
      forced, ar_rows: rows with ar_rows False take forced[:, j] instead of a draw (the sampler's diffusion rows);
        default: every row decodes.
      finished: [B] rows that emit PAD only and count no forwards (finished before this call).
      stop_when_done: leave the loop once every row has emitted EOS (False: always encode all `num_tokens`, so the
        cache holds exactly the committed tokens of every row).

    Returns:
      (tokens [B, num_tokens] int32, cache, last_hidden [B, H], forwards [B] int32 per decoding row while active).
    """
    B = last_hidden.shape[0]
    ar_rows = jnp.ones((B,), bool) if ar_rows is None else ar_rows
    finished = jnp.zeros((B,), bool) if finished is None else finished
    forced = jnp.full((B, num_tokens), pad_id, jnp.int32) if forced is None else forced

    def cond(c):
        j, _, _, _, eos_seen, _ = c
        more = j < num_tokens
        return (more & ~jnp.all(eos_seen | finished)) if stop_when_done else more

    def body(c):
        j, cache, h, out, eos_seen, fwd = c
        logits = model.logits(h[:, None])[:, 0]  # [B, V]
        keys = jax.vmap(jax.random.fold_in)(row_keys, jnp.broadcast_to(key_offset + j, (B,)).astype(jnp.uint32))
        tok = jax.vmap(lambda lg, k: sample_token(lg[None], k, temperature)[0])(logits, keys)
        silent = eos_seen | finished
        fwd = fwd + (ar_rows & ~silent).astype(jnp.int32)
        tok = jnp.where(silent, pad_id, tok)
        tok = jnp.where(ar_rows, tok, forced[:, j]).astype(jnp.int32)
        eos_seen = eos_seen | jnp.isin(tok, eos)
        hidden, cache = model.encode(tok[:, None], cache)
        out = jax.lax.dynamic_update_slice_in_dim(out, tok[:, None], j, axis=1)
        return j + 1, cache, hidden[:, 0], out, eos_seen, fwd

    init = (jnp.int32(0), cache, last_hidden, jnp.full((B, num_tokens), pad_id, jnp.int32), jnp.zeros((B,), bool),
            jnp.zeros((B,), jnp.int32))
    _, cache, h, out, _, fwd = jax.lax.while_loop(cond, body, init)
    return out, cache, h, fwd


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "capacity", "temperature", "eos_ids",
                                             "pad_id"))
def _generate(graphdef, state, prompt, prompt_valid, row_keys, *, max_new_tokens, capacity, temperature, eos_ids,
              pad_id):
    model = nnx.merge(graphdef, state)
    cache = KVCache.init(model.cfg, prompt.shape[0], capacity)
    hidden, cache = model.encode(prompt, cache, prompt_valid)
    out, _, _, fwd = decode_loop(model, cache, hidden[:, -1], max_new_tokens, row_keys, temperature,
                                 jnp.asarray(eos_ids, jnp.int32), pad_id)
    return out, fwd


def generate(model, prompt, prompt_valid=None, *, max_new_tokens: int, temperature: float = 0.0, key=None,
             eos_ids=None, pad_id: int | None = None, return_forwards: bool = False):
    """Decode up to `max_new_tokens` per row. Returns [B, max_new_tokens] int32 (PAD after the first EOS), and the
    forwards per row (tokens up to and including EOS) with `return_forwards`.

    key: a base key (row r uses fold_in(key, r)) or [B] per-row keys.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    prompt_valid = jnp.ones(prompt.shape, bool) if prompt_valid is None else jnp.asarray(prompt_valid, bool)
    cfg = model.cfg
    eos_ids = tuple(cfg.eos_token_id if eos_ids is None else eos_ids)
    pad_id = cfg.pad_token_id if pad_id is None else pad_id
    graphdef, state = nnx.split(model)
    out, fwd = _generate(graphdef, state, prompt, prompt_valid, row_keys_of(key, prompt.shape[0]),
                         max_new_tokens=max_new_tokens, capacity=prompt.shape[1] + max_new_tokens,
                         temperature=float(temperature), eos_ids=eos_ids, pad_id=pad_id)
    return (out, fwd) if return_forwards else out
