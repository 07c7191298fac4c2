"""State recording inside the sampler's denoising loop: what SD·RL needs to replay a visited state (docs/sdrl.md §1).

The block sampler's `while_loop` carries one `StepRecord` per block when `SamplerConfig.record_states` is on; each
iteration writes its slice k with `write` (in-place dynamic-update-slices, so the loop stays one compiled program on
the same sharding). `stack_blocks` turns the per-block records and block metrics into a `RolloutRecord`, the public
type documented in `dgemma.inference.rollout`. Never V-wide logits: the self-conditioning input is stored as the
[L, H] soft embedding the loop already carries (in the activation dtype, bf16 at scale), which makes replay exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

__all__ = ["PER_STEP_FIELDS", "StepRecord", "RolloutRecord", "stack_blocks"]


def _batch_constraint(x: jax.Array, batch_axis: int) -> jax.Array:
    """Shard `x` on its batch axis like the rest of the loop state when a mesh is active (no-op otherwise)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    axes = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    if not axes or x.shape[batch_axis] % size:
        return x
    spec: list[tuple[str, ...] | None] = [None] * x.ndim
    spec[batch_axis] = axes
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


@struct.dataclass
class _PerStepFields:
    """The per-step states both records hold: [K, B, ...] in a `StepRecord`, [nb, K, B, ...] in a `RolloutRecord`."""

    canvas: jax.Array
    soft_embeds: jax.Array | None
    tau: jax.Array
    accept: jax.Array
    draft: jax.Array
    proposal: jax.Array
    mean_entropy: jax.Array
    step_ran: jax.Array


# `logp` is per step too, but optional (records built by hand, e.g. the training rows' one-step records, omit it)
PER_STEP_FIELDS: tuple[str, ...] = (*(f.name for f in dataclasses.fields(_PerStepFields)), "logp")


@struct.dataclass
class StepRecord(_PerStepFields):
    """One block's recorded states, [K, B, ...] (step-major); see `RolloutRecord` for the fields."""

    logp: jax.Array | None = None

    @classmethod
    def init(cls, max_steps: int, batch: int, length: int, hidden: int | None, sc_dtype) -> "StepRecord":
        K, B, L = max_steps, batch, length
        ints = lambda: _batch_constraint(jnp.zeros((K, B, L), jnp.int32), 1)  # noqa: E731
        soft_embeds = None if hidden is None else _batch_constraint(jnp.zeros((K, B, L, hidden), sc_dtype), 1)
        # tau is 1 at unvisited steps: never divide by 0
        return cls(canvas=ints(), soft_embeds=soft_embeds, tau=jnp.ones((K, B), jnp.float32),
                   accept=_batch_constraint(jnp.zeros((K, B, L), bool), 1), draft=ints(), proposal=ints(),
                   mean_entropy=jnp.zeros((K, B), jnp.float32), step_ran=jnp.zeros((K, B), bool),
                   logp=_batch_constraint(jnp.zeros((K, B, L), jnp.float32), 1))

    def write(self, k, *, canvas, soft_embeds, tau, accept, draft, proposal, logp, mean_entropy,
              active) -> "StepRecord":
        """Record step k: its decoder inputs (canvas, SC embedding), τ_k, the decisions taken from its logits and the
        sampler's own tempered log-probability of each proposed token (what replay must give back)."""
        B = canvas.shape[0]
        assert self.logp is not None  # the sampler writes to records made by `init`, which sets logp
        return StepRecord(
            canvas=self.canvas.at[k].set(canvas.astype(jnp.int32)),
            soft_embeds=(None if self.soft_embeds is None
                         else self.soft_embeds.at[k].set(soft_embeds.astype(self.soft_embeds.dtype))),
            tau=self.tau.at[k].set(jnp.broadcast_to(jnp.asarray(tau, jnp.float32), (B,))),
            accept=self.accept.at[k].set(accept),
            draft=self.draft.at[k].set(draft.astype(jnp.int32)),
            proposal=self.proposal.at[k].set(proposal.astype(jnp.int32)),
            logp=self.logp.at[k].set(logp.astype(jnp.float32)),
            mean_entropy=self.mean_entropy.at[k].set(mean_entropy.astype(jnp.float32)),
            step_ran=self.step_ran.at[k].set(active),
        )


@struct.dataclass
class RolloutRecord(_PerStepFields):
    """Recorded denoising states of a sampling run; nb blocks run, K = max_steps, B rows, L canvas, H hidden.

    canvas [nb, K, B, L] int32, soft_embeds [nb, K, B, L, H] (act dtype) or None, tau [nb, K, B] f32,
    accept / draft / proposal [nb, K, B, L], mean_entropy [nb, K, B] f32, step_ran [nb, K, B] bool,
    tokens [nb, B, L] int32 (committed), steps [nb, B] int32, stop_reason [nb, B] int32, block_ran [nb, B] bool,
    logp [nb, K, B, L] f32 (None in records built by hand).
    Field meanings: `dgemma.inference.rollout` (the contract).
    """

    tokens: jax.Array
    steps: jax.Array
    stop_reason: jax.Array
    block_ran: jax.Array
    logp: jax.Array | None = None

    # the record's sizes, read off `canvas` [nb, K, B, L]
    n_blocks = property(lambda self: self.canvas.shape[0], doc="nb, blocks run")
    max_steps = property(lambda self: self.canvas.shape[1], doc="K, the sampler's max_steps")
    batch_size = property(lambda self: self.canvas.shape[2], doc="B, rows")
    canvas_length = property(lambda self: self.canvas.shape[3], doc="L, canvas length")

    def nbytes(self) -> int:
        """Bytes held by the record (device memory of its arrays)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self))

    def rows(self, index) -> "RolloutRecord":
        """The record restricted to rows `index` (array of row indices or a slice), e.g. a training minibatch."""
        idx = jnp.arange(self.batch_size)[index]
        fields: dict[str, Any] = {f: None if getattr(self, f) is None else
                                  jnp.take(getattr(self, f), idx, axis=2 if f in PER_STEP_FIELDS else 1)
                                  for f in self.__dataclass_fields__}  # (a field left None stays None)
        return dataclasses.replace(self, **fields)


@jax.jit
def _stack(steps, tokens, passes, reasons, active) -> RolloutRecord:
    st = jax.tree.map(lambda *xs: jnp.stack(xs), *steps)
    return RolloutRecord(**{f: getattr(st, f) for f in PER_STEP_FIELDS},
                         tokens=jnp.stack(tokens).astype(jnp.int32), steps=jnp.stack(passes).astype(jnp.int32),
                         stop_reason=jnp.stack(reasons).astype(jnp.int32), block_ran=jnp.stack(active).astype(bool))


def stack_blocks(steps: list[StepRecord], tokens: list, passes: list, reasons: list, active: list) -> RolloutRecord:
    """Stack per-block records and block outputs (each a list over blocks) into a `RolloutRecord` (one jitted
    call: no per-field dispatch)."""
    return _stack(list(steps), list(tokens), list(passes), list(reasons), list(active))
