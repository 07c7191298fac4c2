"""dgemma.train: optimizer, train state, the jitted train step, the one trainer and its objectives, stage 2.

Attributes are imported lazily: `import dgemma.train` imports neither jax nor optax.

Modules:
  optim            optax optimizer from `cfg.optim` (AdamW/Adafactor, clipping, warmup+cosine, decay mask, freezing)
  state            `TrainState(params, opt_state, step, rng)`, abstract shapes, shardings, sharded init
  step             `make_train_step(...)` -> jitted `train_step(state, batch) -> (state, metrics)`; `ar_loss_fn`
  objectives       the registry of `trainer.objective` (ar, stage1, sdrl): `Objective`, `get_objective(name)`
  trainer          the one trainer of every objective: `run_training(cfg) -> (TrainSummary, session)`
  batch_session    the session of the one-batch objectives (ar, stage1)
  loop             entry points: `train(cfg, ...)` and `run_objective(cfg, ...)`, both the one trainer
  periodic_eval    held-out evaluation inside the loop every `trainer.eval_every` steps
  resume           what may start or resume where (init_from, checkpoint-dir owner / objective / settings)
  run_dir          run-dir plumbing: the run summary, the non-finite-loss error, the mesh, the atomic run dir
  run_lock         one training process at a time per run and checkpoint directory (`flock`)
  preemption       SIGTERM/SIGINT -> save at the next step boundary
  lora_setup       what the trainer does differently with `lora.rank > 0`, in one place
  lora_init        `checkpoint.init_from` into a run with adapters (base from the checkpoint, adapters fresh)
  lora_checkpoint  run checkpoints of an adapted run: the trainable leaves and a fingerprint of the base
  sdrl/            stage 2 (SD·RL): its session and iteration; `dgemma.train.sdrl.run_sdrl(cfg)`
  study            the SD·RL study (experiments/sdrl_study/README.md): train arms, evaluate, report
  study_toy        the SD·RL study config shrunk to a tiny model, for tests in seconds
  lora_study       the LoRA study (experiments/lora_study/README.md): adapters vs full parameters
  ablation         recipe ablations: one training run of a config variant from a checkpoint
"""

from __future__ import annotations

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
