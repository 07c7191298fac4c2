"""Chunked cross-entropy from hidden states: never materializes [B, T, V] fp32 logits.

Concept
-------
At V = 262,144 one 256-token canvas of fp32 logits is 268 MB per row, so the head and the CE are fused and computed
over chunks of C sequence positions (all B rows at once, so a batch-sharded input stays sharded):

    logits = softcap · tanh( float32(h · Eᵀ) / softcap )        [B, C, V] fp32, only one chunk alive at a time
    nll    = logsumexp(logits) − logits[target]

The chunk loop is a ``lax.map`` whose body is wrapped in ``jax.checkpoint``, so the backward pass recomputes each
chunk's logits instead of storing them: activation memory is O(B · C · V) (per vocab shard when E is vocab-sharded; the
logsumexp and gather then become cross-shard reductions inserted by the partitioner), i.e. O(B · C · V_shard).

The head matmul reads E in the activation dtype with fp32 accumulation, as the model's `decode` (the sampler's head)
and every other weight matmul do, so training and sampling logits agree in bf16. The per-chunk [V, H] gradient of
E that the partitioner may all-reduce over the batch devices is then in the activation dtype (26B on v5p-64 at one
example per chip: bf16 1.47 GB instead of fp32 2.95 GB per chunk; docs/planner_compile.md).

Reduction (eq. 1.9): per example, the weighted mean of the token NLLs over its supervised positions,

    L_example = Σ_j w_j nll_j / Σ_j w_j,

then the plain mean over examples that have any weight (Σ_j w_j > 0). Examples without supervised tokens (dummy or
fully padded rows) are excluded instead of diluting the batch. Weights double as masks (0 = unsupervised).
"""

from __future__ import annotations

from typing import Literal, overload

import jax
import jax.numpy as jnp

__all__ = ["token_nll_from_hidden", "per_example_mean", "ce_from_hidden"]


@overload
def token_nll_from_hidden(hidden: jax.Array, embedding: jax.Array, targets: jax.Array, *, softcap: float | None = ...,
                          chunk: int = ..., with_correct: Literal[False] = ...) -> jax.Array: ...


@overload
def token_nll_from_hidden(hidden: jax.Array, embedding: jax.Array, targets: jax.Array, *, softcap: float | None = ...,
                          chunk: int = ..., with_correct: Literal[True]) -> tuple[jax.Array, jax.Array]: ...


def token_nll_from_hidden(
    hidden: jax.Array,
    embedding: jax.Array,
    targets: jax.Array,
    *,
    softcap: float | None = 30.0,
    chunk: int = 256,
    with_correct: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Per-token −log softmax(head(h))[target] in fp32, chunked over tokens.

    Args:
      hidden: [B, T, H] final hidden states (post final norm), any float dtype.
      embedding: [V, H] tied embedding / unembedding matrix.
      targets: [B, T] int target ids (any value where the weight will be 0; ids are clipped into range).
      softcap: final-logit soft-cap (30.0 for Gemma 4); None disables it.
      chunk: sequence positions per chunk; each step computes [B, chunk, V] logits.

      with_correct: also return [B, T] bool argmax(logits) == target (same chunk loop, no extra logits).

    Returns:
      [B, T] float32 NLL (and the correctness mask when ``with_correct``).
    """
    b, t, h = hidden.shape
    vocab = embedding.shape[0]
    chunk = max(1, min(chunk, t))
    num_chunks = -(-t // chunk)
    pad = num_chunks * chunk - t
    # [B, T, H] -> [n_chunks, B, chunk, H]: the batch axis stays intact (and batch-sharded); we loop over time only
    hs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, num_chunks, chunk, h).swapaxes(0, 1)
    ys = jnp.pad(jnp.clip(targets, 0, vocab - 1).astype(jnp.int32), ((0, 0), (0, pad)))
    ys = ys.reshape(b, num_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def body(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        hc, yc = args  # [B, chunk, H], [B, chunk]
        table = embedding.astype(hc.dtype)  # cast inside the chunk: E's gradient still accumulates in E's dtype
        logits = jnp.einsum("bch,vh->bcv", hc, table, preferred_element_type=jnp.float32)
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, yc[..., None], axis=-1)[..., 0]
        return lse - tgt, jnp.argmax(logits, axis=-1) == yc

    nll, correct = jax.lax.map(body, (hs, ys))  # [n_chunks, B, chunk]

    def unchunk(x):
        return x.swapaxes(0, 1).reshape(b, num_chunks * chunk)[:, :t]

    return (unchunk(nll), unchunk(correct)) if with_correct else unchunk(nll)


def per_example_mean(values: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted mean over all non-batch axes, per example.

    Args:
      values: [B, ...] per-token values.
      weights: [B, ...] non-negative weights (0 = masked), same shape.

    Returns:
      (mean [B], has_weight [B] bool). Rows without weight get mean 0.
    """
    axes = tuple(range(1, values.ndim))
    w = weights.astype(jnp.float32)
    total = jnp.sum(w, axis=axes)
    has = total > 0
    weighted = jnp.where(w > 0, values.astype(jnp.float32) * w, 0.0)  # masked NaN/inf cannot leak
    mean = jnp.sum(weighted, axis=axes) / jnp.where(has, total, 1.0)
    return jnp.where(has, mean, 0.0), has


def ce_from_hidden(
    hidden: jax.Array,
    embedding: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    softcap: float | None = 30.0,
    chunk: int = 256,
) -> jax.Array:
    """Chunked CE: per-example weighted mean, then mean over examples with any weight (module docstring).

    Args:
      hidden: [B, T, H] hidden states.
      embedding: [V, H] head matrix (tied embedding).
      targets: [B, T] int targets.
      weights: [B, T] float/bool weights; 0 masks a position.
      softcap: final-logit soft-cap (None = off).
      chunk: sequence positions per chunk (live logits: B · chunk · V fp32).

    Returns:
      scalar float32 loss (0 if no example has weight).
    """
    nll = token_nll_from_hidden(hidden, embedding, targets, softcap=softcap, chunk=chunk)
    ex_mean, has = per_example_mean(nll, weights)
    n_ex = jnp.sum(has.astype(jnp.float32))
    return jnp.sum(ex_mean) / jnp.maximum(n_ex, 1.0)
