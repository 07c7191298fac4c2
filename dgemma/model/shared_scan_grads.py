"""One parameter-gradient stack for two scans over the same stacked layers (the split-stream stage-1 passes).

Why: the split-stream layout (`diffusion.self_cond_pass: noisy_stream`, `dgemma.diffusion.split_streams`) runs the
scanned layer stack twice with gradients: the clean stream, then the noisy stream over the clean keys and values.
Each transposed `jax.lax.scan` writes its own stacked gradient of every scanned parameter, and the two stacks are
added at the end, so both are alive at once: 11.41 GiB per H100 at 26B on 8 GPUs (the deviceless H100 compile's
`input_add_reduce_fusion` of two `f32[5, 16, 704, 2816]` loop outputs per expert matrix; docs/planner_gpu.md).

    x, kvs, blocks_out = run_scanned_shared(scan_blocks, x, inputs, layer_inputs, run, n)

runs the scan like `dgemma.model.scan.run_scanned` and also returns `blocks_out`: `scan_blocks` again, around the
same arrays passed through. A later use of the layers that runs `blocks_out` instead of `scan_blocks` hands its
parameter cotangent to this scan's backward, which starts its accumulator from it and adds each period's gradient in
place: one stack, the same sums (each element gets the same two addends).

The backward is a reverse scan over the periods that applies each period's VJP, saved by the forward scan (`jax.vjp`
per period, with the model's remat policy inside). Residuals that are the period's own inputs (its parameter slice,
the positions and masks) are not stacked again: the backward re-reads them from the stacked parameters, as JAX's own
scan does.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["run_scanned_shared"]


def run_scanned_shared(scan_blocks: nnx.List, x: jax.Array, inputs: Any,
                       layer_inputs: Callable[[nnx.Module, Any], tuple], run: Callable, n: int):
    """x -> (x, per-layer kvs, blocks_out) through n periods of `scan_blocks` (module docstring).

    `inputs`: a pytree (positions, masks, ...) of arrays and static leaves; `layer_inputs(block, inputs)` -> the
    (positions, mask, prefix, decoder_tokens) arguments of `run` for one block (no cache prefixes here)."""
    graphdef, stacked = nnx.split(scan_blocks)
    P = len(scan_blocks)
    p_leaves, p_tree = jax.tree.flatten(stacked)
    in_leaves, in_tree = jax.tree.flatten(inputs)
    is_array = [isinstance(leaf, jax.Array) for leaf in in_leaves]
    arrays = [leaf for leaf, a in zip(in_leaves, is_array) if a]

    def period(params, h, arrs):
        blocks = nnx.merge(graphdef, jax.tree.unflatten(p_tree, params))
        it = iter(arrs)
        inp = jax.tree.unflatten(in_tree, [next(it) if a else leaf for leaf, a in zip(in_leaves, is_array)])
        kvs = []
        for j in range(P):
            h, kv = run(blocks[j], h, *layer_inputs(blocks[j], inp))
            kvs.append(kv)
        return h, tuple(kvs)

    layout: dict[str, Any] = {}  # the VJP's pytree and where its input leaves sit, recorded when the forward traces

    @jax.custom_vjp
    def scanned(params, h, arrs):
        h, kvs = jax.lax.scan(lambda c, ps: period(ps, c, arrs), h, params, length=n)
        return h, kvs, params

    def scanned_fwd(params, h, arrs):
        def body(carry, ps):
            (out, kvs), vjp = jax.vjp(lambda p, c: period(p, c, arrs), ps, carry)
            leaves, tree = jax.tree.flatten(vjp)
            own = {id(v): ("param", k) for k, v in enumerate(ps)}
            own.update({id(v): ("input", k) for k, v in enumerate(arrs)})
            layout["tree"], layout["where"] = tree, [own.get(id(leaf)) for leaf in leaves]
            return out, (kvs, [leaf for leaf in leaves if id(leaf) not in own])

        out, (kvs, saved) = jax.lax.scan(body, h, params, length=n)
        return (out, kvs, params), (params, arrs, saved)

    def scanned_bwd(res, cts):
        params, arrs, saved = res
        ct_h, ct_kvs, ct_params = cts

        def body(carry, xs):
            ct, acc = carry
            i, ps, saved_i, ct_kv = xs
            it = iter(saved_i)
            leaves = [next(it) if w is None else (ps if w[0] == "param" else arrs)[w[1]] for w in layout["where"]]
            d_params, d_h = jax.tree.unflatten(layout["tree"], leaves)((ct, ct_kv))
            acc = [jax.lax.dynamic_update_index_in_dim(
                a, jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) + d.astype(a.dtype), i, 0)
                for a, d in zip(acc, d_params)]
            return (d_h, acc), None

        (ct_x, acc), _ = jax.lax.scan(body, (ct_h, list(ct_params)), (jnp.arange(n), params, saved, ct_kvs),
                                      reverse=True)
        return acc, ct_x, None

    scanned.defvjp(scanned_fwd, scanned_bwd)
    x, kvs, params_out = scanned(p_leaves, x, arrays)
    per_layer: list[tuple[jax.Array, jax.Array] | None] = [None] * (n * P)
    for j, (k, v) in enumerate(kvs):
        for p in range(n):
            per_layer[p * P + j] = (k[p], v[p])
    return x, per_layer, nnx.merge(graphdef, jax.tree.unflatten(p_tree, params_out))
