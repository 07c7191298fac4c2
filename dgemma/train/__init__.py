"""dgemma.train: optimizer, train state, the jitted train step and the training loop.

Modules:
  optim       optax optimizer from `cfg.optim` (AdamW/Adafactor, clipping, warmup+cosine, decay mask, freezing)
  state       `TrainState(params, opt_state, step, rng)`, abstract shapes, shardings, sharded init
  step        `make_train_step(...)` -> jitted `train_step(state, batch) -> (state, metrics)`
  preemption  SIGTERM/SIGINT -> save at the next step boundary
  objectives  the registry of `trainer.objective` (ar, stage1, sdrl): `Objective`, `get_objective(name)`
  trainer     the one trainer of every objective, `train(cfg) -> TrainSummary` (the entry point): `setup_training`,
              `restore_or_init`, `train_loop`; `run_training` also returns the session
  adaptation  full-parameter vs adapter (LoRA) training, one object chosen per run
  session     the trainer / session contract: `RunContext`, `Session`, `StepOutput`; step_report: a step's metrics
  batch_session  the session of the one-batch objectives (ar, stage1)
  resume      what may start or resume where (init_from, checkpoint-dir owner / objective / settings, data state)
  run_dir     the atomic run dir and its resolved config; run_lock: run / checkpoint dir locks
  summary     `TrainSummary`, what a run returns; nonfinite: `NonFiniteLossError`, what stops it at a NaN/inf loss
  sdrl        stage 2 (SD·RL): its session and iteration; `dgemma.train.sdrl.run_sdrl(cfg)`

Attributes are imported lazily: `import dgemma.train` imports neither jax nor optax.
"""

from __future__ import annotations

from dgemma._lazy import lazy_exports

_EXPORTS = {
    "optim": ("Optimizer", "build_optimizer", "decay_mask", "frozen_flags", "make_schedule", "param_labels",
              "param_path", "param_paths"),
    "state": ("ModelFactory", "TrainState", "abstract_train_state", "broadcast_prefix", "init_train_state",
              "replicated", "split_params", "train_state_shardings", "with_shardings"),
    "step": ("Batch", "LossFn", "batch_sharding", "make_train_step"),
    "preemption": ("PreemptionGuard", "any_process"),
    "nonfinite": ("NonFiniteLossError",),
    "summary": ("TrainSummary",),
    "run_dir": ("prepare_run_dir", "record_config", "recorded_config_sha"),
    "objectives": ("OBJECTIVES", "REGISTRY", "TRAIN_METRICS", "Objective", "get_objective", "loss_fn_for"),
    "session": ("RunContext", "Session", "StepOutput"),
    "trainer": ("restore_or_init", "run_training", "setup_training", "train", "train_loop"),
    "adaptation": ("Adaptation", "Adapters", "FullParams", "adaptation_for"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
