"""dgemma.train: optimizer, train state, the jitted train step, the one trainer and its objectives, stage 2.

Attributes are imported lazily: `import dgemma.train` imports neither jax nor optax.

Modules:
  optim            optax optimizer from `cfg.optim` (AdamW/Adafactor, clipping, warmup+cosine, decay mask, freezing)
  state            `TrainState(params, opt_state, step, rng)`, abstract shapes, shardings, sharded init
  step             `make_train_step(...)` -> jitted `train_step(state, batch) -> (state, metrics)`
  objectives       the registry of `trainer.objective` (ar, stage1, sdrl): `Objective`, `get_objective(name)`
  trainer          the one trainer, `train(cfg) -> TrainSummary` (the entry point; `return_session=True` also
                   returns the objective's session): `setup_training`, `restore_or_init`, `train_loop`
  adaptation       full-parameter vs adapter (LoRA) training: one object chosen per run (`adaptation_for`)
  session          the trainer / session contract: `RunContext`, `Session`, `StepOutput`
  step_report      a step's metrics, timing and log line
  batch_session    the session of the one-batch objectives (ar, stage1)
  periodic_eval    held-out evaluation inside the loop every `trainer.eval_every` steps
  resume           what may start or resume where (init_from, checkpoint-dir owner / objective / settings)
  run_dir          the atomic run dir and its resolved config
  run_lock         one training process at a time per run and checkpoint directory (`flock`), taken first
  summary          `TrainSummary`, what a run returns
  nonfinite        `NonFiniteLossError`, what stops a run at a NaN/inf loss
  preemption       SIGTERM/SIGINT -> save at the next step boundary
  lora_setup       what the trainer does differently with `lora.rank > 0` (reached through `adaptation`)
  lora_init        `checkpoint.init_from` into a run with adapters (base from the checkpoint, adapters fresh)
  lora_checkpoint  run checkpoints of an adapted run: the trainable leaves and a fingerprint of the base
  ablation         train a config variant through the trainer (the ablation studies' building block)
  study            reusable parts of the SD·RL study: arm configs, held-out prompts, restore, evaluation, tables
  study_toy        the SD·RL study config shrunk to a tiny model, for tests in seconds
  sdrl/            stage 2 (SD·RL): its session and iteration; `dgemma.train.sdrl.run_sdrl(cfg)`
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    "trainer": ("restore_or_init", "setup_training", "train", "train_loop"),
    "adaptation": ("Adaptation", "Adapters", "FullParams", "adaptation_for"),
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
    from dgemma.train.step import Batch, LossFn, batch_sharding, make_train_step
    from dgemma.train.preemption import PreemptionGuard, any_process
    from dgemma.train.nonfinite import NonFiniteLossError
    from dgemma.train.summary import TrainSummary
    from dgemma.train.run_dir import prepare_run_dir, record_config, recorded_config_sha
    from dgemma.train.objectives import OBJECTIVES, REGISTRY, TRAIN_METRICS, Objective, get_objective, loss_fn_for
    from dgemma.train.session import RunContext, Session, StepOutput
    from dgemma.train.trainer import restore_or_init, setup_training, train, train_loop
    from dgemma.train.adaptation import Adaptation, Adapters, FullParams, adaptation_for
