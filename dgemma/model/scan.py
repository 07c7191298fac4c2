"""Scanned layers and rematerialisation policies of the transformer stack.

Scanned layout (`model.execution.scan_layers=true`, period P = `model.execution.scan_period`,
n = num_hidden_layers // P):

    scan_blocks/j/...   position j of the period (0 <= j < P), every parameter stacked: [n, ...], logical axes
                        ("layers", ...) -- "layers" is in no rule preset, so the stack axis is never sharded
    tail_blocks/k/...   the num_hidden_layers % P last layers (layer n*P + k), unscanned, per-layer shapes

Layer i < n*P is `scan_blocks/(i % P)` at index i // P. The per-layer layout (`layers/i/...`) stays the layout of
HF conversion and of params checkpoints written by `dgemma convert`; `stack_state` / `unstack_state` convert a
flat state between the two (`dgemma.convert.keymap` maps paths). A scanned model built with the same seed holds
exactly the weights of the per-layer one (each layer draws the same random numbers), so the two compute the same
function.

The stack runs as one `jax.lax.scan` over the n periods whose body runs the P blocks, so the compiled program holds
one period whatever the depth. Remat wraps each block call (inside the scan body when scanned):

| policy      | kept for the backward pass (per block)                               | recomputed                  |
|-------------|----------------------------------------------------------------------|-----------------------------|
| none        | everything the autodiff saves (attention scores, MoE buffers, norms) | nothing                     |
| full/block  | the block's input only                                               | the whole block             |
| save_dots   | the block input and outputs of matmuls with weights (no batch dims)  | attention, softmax, norms   |
| offload     | as save_dots, but the matmul outputs go to host memory               | as save_dots                |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

if TYPE_CHECKING:
    from dgemma.model.config import ModelConfig

__all__ = ["REMAT_POLICIES", "remat_block_fn", "run_scanned", "scan_geometry", "stack_blocks", "stack_state",
           "unstack_state"]

REMAT_POLICIES = ("none", "block", "full", "save_dots", "offload")
STACK_AXIS = "layers"


def scan_geometry(cfg: ModelConfig) -> tuple[int, int, int]:
    """(period P, number of scanned periods n, number of unscanned tail layers)."""
    P = cfg.execution.scan_period
    n = cfg.num_hidden_layers // P
    return P, n, cfg.num_hidden_layers - n * P


def _policy(name: str):
    cp = jax.checkpoint_policies
    if name in ("full", "block"):
        return cp.nothing_saveable
    if name == "save_dots":
        return cp.dots_with_no_batch_dims_saveable
    if name == "offload":
        return cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    raise ValueError(f"model.execution.remat: {name!r} is not one of {REMAT_POLICIES}")


def remat_block_fn(run: Callable, policy: str, static_mode: bool) -> Callable:
    """`run(block, x, positions, mask, prefix, decoder_tokens)` wrapped in `nnx.remat` with the policy (or as is)."""
    if policy == "none":
        return run
    # a Python-bool decoder_tokens (mode flag) must stay static; a [B, T] array is traced
    return nnx.remat(run, policy=_policy(policy), static_argnums=(5,) if static_mode else ())


# MARK: parameter layout ----------------------------------------------------------------------------------------
def _stack_variables(variables: list[nnx.Variable]) -> nnx.Variable:
    first = variables[0]
    axes = first.get_metadata().get("axes") or (None,) * first.ndim
    return first.replace(jnp.stack([v[...] for v in variables]), axes=(STACK_AXIS, *axes))


def stack_blocks(blocks: Sequence[nnx.Module]) -> nnx.Module:
    """One module of `blocks[0]`'s structure whose Variables stack the blocks' Variables on a new leading axis."""
    graphdef, first = nnx.split(blocks[0])
    states = [first] + [nnx.split(b)[1] for b in blocks[1:]]
    stacked = jax.tree.map(lambda *vs: _stack_variables(list(vs)), *states,
                           is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, stacked)


def _layer_of(cfg: ModelConfig, path: tuple) -> tuple[tuple, int | None]:
    """Per-layer path -> (scanned path, index in the stack or None)."""
    if path[:1] != ("layers",):
        return path, None
    P, n, _ = scan_geometry(cfg)
    i = int(path[1])
    if i < n * P:
        return ("scan_blocks", i % P, *path[2:]), i // P
    return ("tail_blocks", i - n * P, *path[2:]), None


def stack_state(cfg: ModelConfig, flat: dict[tuple, Any]) -> dict[tuple, Any]:
    """{per-layer path: array} -> {scanned path: array} (stacked arrays for the scanned layers)."""
    out: dict[tuple, Any] = {}
    groups: dict[tuple, dict[int, Any]] = {}
    for path, value in flat.items():
        new, index = _layer_of(cfg, tuple(path))
        if index is None:
            out[new] = value
        else:
            groups.setdefault(new, {})[index] = value
    for new, parts in groups.items():
        out[new] = jnp.stack([parts[i] for i in range(len(parts))])
    return out


def unstack_state(cfg: ModelConfig, flat: dict[tuple, Any]) -> dict[tuple, Any]:
    """{scanned path: array} -> {per-layer path: array} (slices of the stacked arrays)."""
    P, n, _ = scan_geometry(cfg)
    out: dict[tuple, Any] = {}
    for path, value in flat.items():
        path = tuple(path)
        if path[:1] == ("scan_blocks",):
            for p in range(n):
                out[("layers", p * P + int(path[1]), *path[2:])] = value[p]
        elif path[:1] == ("tail_blocks",):
            out[("layers", n * P + int(path[1]), *path[2:])] = value
        else:
            out[path] = value
    return out


# MARK: forward ----------------------------------------------------------------------------------------------
def run_scanned(scan_blocks: nnx.List, x: jax.Array, layer_inputs: Callable[[nnx.Module, Any], tuple],
                run: Callable, n: int, cache_prefixes: tuple | None = None):
    """x -> (x, kvs) through n periods of `scan_blocks` (an nnx.List of P stacked Blocks) with `jax.lax.scan`.

    `layer_inputs(block, prefix)` -> the (positions, mask, prefix, decoder_tokens) arguments of `run` for one block;
    `cache_prefixes` per position j: (keys [n, ...], values [n, ...]) or None. Returns kvs as a list over layers.
    """
    graphdef, stacked = nnx.split(scan_blocks)
    P = len(scan_blocks)

    def body(carry, xs):
        params, prefixes = xs
        blocks = nnx.merge(graphdef, params)
        kvs = []
        for j in range(P):
            prefix = None if prefixes is None else prefixes[j]
            carry, kv = run(blocks[j], carry, *layer_inputs(blocks[j], prefix))
            kvs.append(kv)
        return carry, tuple(kvs)

    x, kvs = jax.lax.scan(body, x, (stacked, cache_prefixes), length=n)
    per_layer: list[tuple[jax.Array, jax.Array] | None] = [None] * (n * P)
    for j, (k, v) in enumerate(kvs):
        for p in range(n):
            per_layer[p * P + j] = (k[p], v[p])
    return x, per_layer
