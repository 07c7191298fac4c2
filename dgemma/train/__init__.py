"""dgemma.train: optimizer, train state, the jitted train step and the training loop.

Modules:
  optim       optax optimizer from `cfg.optim` (AdamW/Adafactor, clipping, warmup+cosine, decay mask, freezing)
  state       `TrainState(params, opt_state, step, rng)`, abstract shapes, shardings, sharded init
  step        `make_train_step(...)` -> jitted `train_step(state, batch) -> (state, metrics)`; `ar_loss_fn`
  preemption  SIGTERM/SIGINT -> save at the next step boundary
  objectives  the registry of `trainer.objective` (ar, stage1, sdrl): `Objective`, `get_objective(name)`
  trainer     the one trainer of every objective: `run_training(cfg) -> (TrainSummary, session)`
  batch_session  the session of the one-batch objectives (ar, stage1)
  resume      what may start or resume where (init_from, checkpoint-dir owner / objective / settings, data state)
  loop        `train(cfg, data=..., loss_fn=..., model_factory=...) -> TrainSummary` (the trainer); `run_objective`
  run_dir     run-dir plumbing (summary, non-finite error, atomic run dir); run_lock: run / checkpoint dir locks
  sdrl        stage 2 (SD·RL): its session and iteration; `dgemma.train.sdrl.run_sdrl(cfg)`

Attributes are imported lazily: `import dgemma.train` imports neither jax nor optax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgemma._lazy import lazy_exports

_EXPORTS = {
    "optim": ("Optimizer", "build_optimizer", "decay_mask", "frozen_flags", "make_schedule", "param_labels",
              "param_path", "param_paths"),
    "state": ("ModelFactory", "TrainState", "abstract_train_state", "broadcast_prefix", "init_train_state",
              "replicated", "split_params", "train_state_shardings", "with_shardings"),
    "step": ("Batch", "LossFn", "ar_loss_fn", "batch_sharding", "make_train_step"),
    "preemption": ("PreemptionGuard", "any_process"),
    "loop": ("NonFiniteLossError", "TrainSummary", "build_mesh", "prepare_run_dir", "run_objective", "train"),
    "objectives": ("OBJECTIVES", "REGISTRY", "TRAIN_METRICS", "Objective", "get_objective", "loss_fn_for"),
    "trainer": ("RunContext", "Session", "StepOutput", "run_training"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # the type checker sees the lazily exported names' own types
    from dgemma.train.optim import (
        Optimizer, build_optimizer, decay_mask, frozen_flags, make_schedule, param_labels, param_path, param_paths,
    )
    from dgemma.train.state import (
        ModelFactory, TrainState, abstract_train_state, broadcast_prefix, init_train_state, replicated, split_params,
        train_state_shardings, with_shardings,
    )
    from dgemma.train.step import Batch, LossFn, ar_loss_fn, batch_sharding, make_train_step
    from dgemma.train.preemption import PreemptionGuard, any_process
    from dgemma.train.loop import NonFiniteLossError, TrainSummary, build_mesh, prepare_run_dir, run_objective, train
    from dgemma.train.objectives import OBJECTIVES, REGISTRY, TRAIN_METRICS, Objective, get_objective, loss_fn_for
    from dgemma.train.trainer import RunContext, Session, StepOutput, run_training
