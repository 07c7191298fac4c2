"""The functional, jitted train step: `train_step(state, batch) -> (state, metrics)`, with explicit shardings.

    step_fn = make_train_step(graphdef, optimizer, loss_fn, mesh=mesh, shardings=state_shardings)
    state, metrics = step_fn(state, global_batch)        # state is donated; metrics are replicated fp32 scalars

A loss is any `loss_fn(model, batch, rng) -> (loss, aux)`: `model` is the NNX module rebuilt inside the step with
`nnx.merge(graphdef, params)` (the graphdef/state split-merge pattern of Flax's `examples/gemma`), `batch` the dict of
global arrays, `rng` a typed key equal to `fold_in(base_key, step)` (and `fold_in(that, i)` for micro-batch i under
gradient accumulation); `aux` is a dict of fp32 scalars that is averaged over micro-batches and returned as metrics.
Every objective's loss plugs in here (`dgemma.train.objectives`; the losses live in `dgemma.diffusion`).

Shardings (docs/architecture.md §3): the state follows `train_state_shardings` (params through the logical-axis rules, the
optimizer state following the params, scalars replicated); every batch leaf is sharded on its leading axis over
('data', 'fsdp'); metrics are replicated. `donate_argnums=0` lets XLA update the state in place.

Per step:
  1. grads of the loss w.r.t. the trainable params (frozen leaves enter through `stop_gradient`);
     with `grad_accum_steps = k` the batch is split into k strided micro-batches (micro-batch i = rows i, i+k, ...,
     so each stays spread over all data shards), their grads and metrics are averaged in a `lax.scan`;
  2. `grad_norm` = global norm of the trainable grads before clipping; `lr = schedule(step)`;
  3. optax update; frozen leaves are passed through untouched (bit-identical);
  4. step += 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dgemma.train.optim import Optimizer, frozen_flags
from dgemma.train.state import TrainState, replicated

__all__ = ["BATCH_AXES", "Batch", "LossFn", "batch_sharding", "make_train_step"]

Batch = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
BATCH_AXES = ("data", "fsdp")


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis over ('data', 'fsdp'); all other axes replicated. Applies to a leaf of any rank >= 1."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def _split_microbatches(batch: Batch, k: int) -> Batch:
    def split(x):
        b = x.shape[0]
        if b % k:
            raise ValueError(f"batch size {b} is not divisible by grad_accum_steps={k}")
        return jnp.swapaxes(x.reshape(b // k, k, *x.shape[1:]), 0, 1)  # micro-batch i = rows i, i+k, ...

    return jax.tree.map(split, batch)


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: Optimizer,
    loss_fn: LossFn,
    *,
    mesh: Mesh | None = None,
    shardings: TrainState | None = None,
    grad_accum_steps: int = 1,
    donate: bool = True,
) -> jax.stages.Wrapped:
    """Jitted `train_step(state, batch) -> (state, metrics)` (module docstring); a jitted function, so it also has
    `.lower(...)` for ahead-of-time compilation.

    Args:
      graphdef: the model's graph definition (`split_params`).
      optimizer: `build_optimizer(...)` (tx, schedule, freeze regexes).
      loss_fn: `loss_fn(model, batch, rng) -> (loss, aux)`.
      mesh: device mesh; with `shardings` the step gets explicit in/out shardings. None: plain jit.
      shardings: `train_state_shardings(...)` for `mesh`.
      grad_accum_steps: micro-batches per optimizer step (the batch size must be divisible by it).
      donate: donate the input state's buffers.
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps} must be >= 1")
    tx, schedule, freeze = optimizer.tx, optimizer.schedule, tuple(optimizer.freeze)
    mb_sharding = batch_sharding(mesh) if mesh is not None else None

    def loss_of(params: nnx.State, batch: Batch, key: jax.Array, flags: Sequence[bool]):
        leaves, treedef = jax.tree.flatten(params)
        leaves = [jax.lax.stop_gradient(x) if f else x for x, f in zip(leaves, flags)]
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        loss, aux = loss_fn(model, batch, key)
        aux = {k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}
        return jnp.asarray(loss, jnp.float32), aux

    def compute_grads(params, batch, key, flags):
        grad_fn = jax.value_and_grad(functools.partial(loss_of, flags=flags), has_aux=True)
        if grad_accum_steps == 1:
            return grad_fn(params, batch, key)
        micro = _split_microbatches(batch, grad_accum_steps)

        def body(carry, xs):
            mb, i = xs
            if mb_sharding is not None:
                mb = jax.lax.with_sharding_constraint(mb, mb_sharding)
            (loss, aux), grads = grad_fn(params, mb, jax.random.fold_in(key, i))
            acc_loss, acc_aux, acc_grads = carry
            return (acc_loss + loss, jax.tree.map(jnp.add, acc_aux, aux), jax.tree.map(jnp.add, acc_grads, grads)), None

        first = jax.tree.map(lambda x: x[0], micro)
        (_, aux_shape), _ = jax.eval_shape(grad_fn, params, first, key)
        init = (jnp.zeros((), jnp.float32), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape),
                jax.tree.map(jnp.zeros_like, params))
        (loss, aux, grads), _ = jax.lax.scan(body, init, (micro, jnp.arange(grad_accum_steps)))
        inv = 1.0 / grad_accum_steps
        return (loss * inv, jax.tree.map(lambda a: a * inv, aux)), jax.tree.map(lambda g: g * inv, grads)

    def train_step(state: TrainState, batch: Batch):
        flags = frozen_flags(state.params, freeze)  # static: depends on the tree's paths only
        key = jax.random.fold_in(state.key(), state.step)
        (loss, aux), grads = compute_grads(state.params, batch, key, flags)
        grad_leaves = jax.tree.leaves(grads)
        grad_norm = optax.global_norm([g for g, f in zip(grad_leaves, flags) if not f])
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        old_leaves, treedef = jax.tree.flatten(state.params)
        new_leaves = jax.tree.leaves(new_params)
        params = jax.tree.unflatten(treedef, [o if f else n for o, n, f in zip(old_leaves, new_leaves, flags)])
        metrics = {**aux, "loss": loss, "grad_norm": grad_norm.astype(jnp.float32),
                   "lr": jnp.asarray(schedule(state.step), jnp.float32)}
        new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=state.rng)
        return new_state, metrics

    donate_argnums = (0,) if donate else ()
    if mesh is None or shardings is None:
        return jax.jit(train_step, donate_argnums=donate_argnums)
    return jax.jit(train_step, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, replicated(mesh)), donate_argnums=donate_argnums)
