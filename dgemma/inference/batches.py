"""Combining `SampleResult`s of several batches.

The sampler stops a batch as soon as every row has finished, so two batches of the same request can run different
numbers of blocks: their per-block arrays ([B, n_blocks, ...], drafts [n_blocks, K, B, L], tokens [B, L·n_blocks])
do not stack. Padding a result to more blocks adds blocks in which no row took part, with the values the sampler
itself writes for a finished row: 0 decoder steps, stop reason EOS_FINISHED, NaN entropy, commit step 0 (no
diffusion), PAD tokens and PAD drafts. Aggregates that select "took part" blocks (steps > 0) are unchanged by it.

A batch decoded on a mesh is split over the mesh's batch axes ('data', 'fsdp'), so its row count must be a multiple
of their size (`batch_shards`). `pad_rows` fills the last shard with copies of the last row (same prompt, same key:
the copies decode exactly what that row decodes, so neither the lockstep loop nor any real row changes) and
`take_rows` drops them from the result.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dgemma.inference.sampler_types import EOS_FINISHED, SampleResult


def _pad_axis(a: np.ndarray, axis: int, size: int, fill) -> np.ndarray:
    missing = size - a.shape[axis]
    if missing <= 0:
        return a
    shape = list(a.shape)
    shape[axis] = missing
    return np.concatenate([a, np.full(shape, fill, a.dtype)], axis=axis)


def pad_blocks(res: SampleResult, n_blocks: int, pad_id: int) -> SampleResult:
    """`res` with its per-block arrays extended to `n_blocks` blocks in which no row took part (cache dropped)."""
    have = res.n_blocks
    if n_blocks < have:
        raise ValueError(f"pad_blocks: result has {have} blocks, cannot pad to {n_blocks}")
    tokens = res.tokens
    if have and n_blocks > have:  # pure-AR results have no blocks; their token width is max_new_tokens
        L = tokens.shape[1] // have
        tokens = _pad_axis(tokens, 1, L * n_blocks, pad_id)
    return dataclasses.replace(
        res, tokens=tokens,
        steps_per_block=_pad_axis(res.steps_per_block, 1, n_blocks, 0),
        stop_reason=_pad_axis(res.stop_reason, 1, n_blocks, EOS_FINISHED),
        entropy_trace=_pad_axis(res.entropy_trace, 1, n_blocks, np.nan),
        commit_step=_pad_axis(res.commit_step, 1, n_blocks, 0),
        steps_run=_pad_axis(res.steps_run, 0, n_blocks, 0),
        drafts=None if res.drafts is None else _pad_axis(res.drafts, 0, n_blocks, pad_id),
        cache=None)


def concat_results(results: list[SampleResult], pad_id: int) -> SampleResult:
    """One result with the rows of every batch, blocks padded to the largest block count (see module docstring).

    `steps_run` is the per-block maximum over batches (each batch ran its own lockstep loop); `cache` is None.
    """
    if not results:
        raise ValueError("concat_results: no results")
    n = max(r.n_blocks for r in results)
    padded = [pad_blocks(r, n, pad_id) for r in results]
    rows = lambda name, axis=0: np.concatenate([getattr(r, name) for r in padded], axis=axis)  # noqa: E731
    widths = {r.tokens.shape[1] for r in padded}
    if len(widths) > 1:
        raise ValueError(f"concat_results: token widths {sorted(widths)} differ after padding to {n} blocks")
    return SampleResult(
        tokens=rows("tokens"), tpf=rows("tpf"),
        tpf_total=rows("tpf_total"), decoder_passes=rows("decoder_passes"),
        ar_forwards=rows("ar_forwards"), commit_passes=rows("commit_passes"), steps_per_block=rows("steps_per_block"),
        stop_reason=rows("stop_reason"), entropy_trace=rows("entropy_trace"), commit_step=rows("commit_step"),
        steps_run=np.max(np.stack([r.steps_run for r in padded]), axis=0) if n else np.zeros(0, np.int32),
        mode=tuple(m for r in padded for m in r.mode),
        drafts=rows("drafts", axis=2) if all(r.drafts is not None for r in padded) else None)


def global_rows(x, sharding):
    """`x`, a batch every process holds whole (the same prompts, the same held-out rows), as one array split by
    `sharding` over a mesh that may span processes: each process places the rows of its own devices (`jax.device_put`
    takes only a sharding whose devices this process addresses). Typed PRNG keys go through their key data."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = global_rows(jax.random.key_data(x), NamedSharding(sharding.mesh, P(*sharding.spec, None)))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def batch_shards(mesh) -> int:
    """How many shards a mesh splits the batch into: the product of its 'data' and 'fsdp' axis sizes."""
    return int(np.prod([mesh.shape[a] for a in ("data", "fsdp") if a in mesh.axis_names], dtype=np.int64))


def pad_rows(x, n: int):
    """`x` (numpy or jax, rows first) with `n` copies of its last row appended."""
    import jax.numpy as jnp

    xp = np if isinstance(x, np.ndarray) else jnp
    return xp.concatenate([x, xp.repeat(x[-1:], n, axis=0)], axis=0)


def take_rows(res: SampleResult, n: int) -> SampleResult:
    """The first `n` rows of `res` (every per-row array; drafts [n_blocks, K, B, L] on axis 2; the cache's rows)."""
    per_row = ("tokens", "tpf", "tpf_total", "decoder_passes", "ar_forwards", "commit_passes", "steps_per_block",
               "stop_reason", "entropy_trace", "commit_step")
    cache = res.cache
    if cache is not None:
        cache = dataclasses.replace(cache, keys=tuple(k[:n] for k in cache.keys),
                                    values=tuple(v[:n] for v in cache.values), valid=cache.valid[:n])
    if res.record is not None:
        raise ValueError("take_rows: a result with recorded states cannot be cut to fewer rows")
    return dataclasses.replace(res, **{f: getattr(res, f)[:n] for f in per_row}, mode=res.mode[:n],
                               drafts=None if res.drafts is None else res.drafts[:, :, :n], cache=cache)
