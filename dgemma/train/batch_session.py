"""The session of the one-batch objectives (ar, stage1): one trainer step = one optimizer update on one batch.

The update is `dgemma.train.step.make_train_step` with the objective's loss (or the caller's `loss_fn`) and
`trainer.grad_accum_steps` micro-batches, compiled ahead of time against the abstract state and a global batch of
the data's shapes (compile time is reported apart from step time; a batch the mesh cannot shard fails here, before
the run dir exists). Its checkpoint item is the `TrainState` itself. Evaluation: `dgemma.train.periodic_eval`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from dgemma.train.session import RunContext, StepOutput

__all__ = ["BatchSession"]


def _example_batch(data: Any) -> dict:
    if hasattr(data, "batch"):
        return data.batch(0)
    it = data.iterator_from_step(0)
    try:
        return next(it)
    finally:
        if hasattr(it, "close"):
            it.close()


def abstract_batch(data: Any, sharding, mesh) -> dict:
    """Global ShapeDtypeStructs (with the batch sharding) of one batch; checks batch divisibility by the mesh."""
    n = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    out = {}
    for k, v in _example_batch(data).items():
        v = np.asarray(v)
        b = v.shape[0] * jax.process_count()
        if b % n:
            raise ValueError(f"global batch size {b} (batch[{k!r}]) is not divisible by the batch-sharding mesh axes "
                             f"data x fsdp = {n}")
        out[k] = jax.ShapeDtypeStruct((b, *v.shape[1:]), jax.dtypes.canonicalize_dtype(v.dtype), sharding=sharding)
    return out


def _tokens_in(batch: dict) -> int:
    x = batch.get("tokens", next(iter(batch.values())))
    return int(np.size(x)) * jax.process_count()


class BatchSession:
    """`dgemma.train.trainer.Session` of ar / stage1 (module docstring)."""

    @classmethod
    def prepare(cls, cfg: Any, data: Any, *, loss_fn=None) -> dict:
        """The session's arguments, checked before the mesh exists: the periodic evaluation's held-out set (its
        files read and checked against the training files)."""
        held_out = None
        if cfg.trainer.eval_every:
            from dgemma.train.periodic_eval import held_out_for

            held_out = held_out_for(cfg, data)
        return {"loss_fn": loss_fn, "held_out": held_out}

    def __init__(self, ctx: RunContext, *, loss_fn=None, held_out=None):
        from dgemma.train import step as step_lib

        cfg = ctx.cfg
        self.ctx = ctx
        self.evaluator = None
        if cfg.trainer.eval_every:  # held-out set and sampler settings are checked before anything is written
            from dgemma.train.periodic_eval import PeriodicEval

            self.evaluator = PeriodicEval(cfg, ctx.graphdef, held_out=held_out, mesh=ctx.mesh)
        loss_fn = ctx.objective.loss_fn(cfg) if loss_fn is None else loss_fn
        from dgemma.parallel.checks import batch_layout

        # data.batch_size is the global batch; the accumulation may be derived from the mesh (grad_accum_steps=0)
        self.layout = batch_layout(getattr(ctx.data, "global_batch_size", cfg.data.batch_size), jax.process_count(),
                                   ctx.mesh, cfg.mesh.rules, cfg.trainer.grad_accum_steps)
        logging.getLogger(__name__).debug("batch: %s", self.layout.describe())  # `dgemma train` prints it
        self.step_fn = step_lib.make_train_step(ctx.graphdef, ctx.optimizer, loss_fn, mesh=ctx.mesh,
                                                shardings=ctx.shardings,
                                                grad_accum_steps=self.layout.grad_accum_steps)
        self.bsh = step_lib.batch_sharding(ctx.mesh)
        self.compiled: Callable[..., Any] = self.step_fn  # the jitted step, then its ahead-of-time compilation

    def compile(self, target: Any) -> float:
        from dgemma.parallel.mesh import use_mesh

        t0 = time.time()
        with use_mesh(self.ctx.mesh):  # so sharding constraints inside the model resolve against this mesh
            self.compiled = self.step_fn.lower(target, abstract_batch(self.ctx.data, self.bsh, self.ctx.mesh)).compile()
        return time.time() - t0

    def restore_target(self, target: Any) -> Any:
        return target

    def from_restored(self, item: Any, state: dict | None) -> Any:
        return item

    def fresh(self, state: Any) -> Any:
        return state

    def step(self, state: Any, batch: dict, index: int) -> StepOutput:
        from dgemma.data.pipeline import to_global_batch
        from dgemma.parallel.mesh import use_mesh

        tokens = _tokens_in(batch)
        global_batch = to_global_batch(batch, self.bsh)
        with use_mesh(self.ctx.mesh):
            state, metrics = self.compiled(state, global_batch)
        return StepOutput(state=state, metrics=metrics, tokens=tokens)

    def checkpoint_item(self, state: Any) -> Any:
        return state

    def objective_state(self) -> dict | None:
        return None

    def evaluate(self, state: Any, step: int) -> dict[str, float] | None:
        if self.evaluator is None:
            return None
        from dgemma.parallel.mesh import use_mesh

        with use_mesh(self.ctx.mesh):
            return self.evaluator(state.params, step)
