"""The objective registry: `trainer.objective` -> what trains. One place that maps a config to its loss / runner.

    loss_fn = loss_fn_for(cfg)      # LossFn for dgemma.train.step.make_train_step / dgemma.train.loop.train
    summary = dgemma.train.loop.run_objective(cfg)   # ar / stage1: `train`; sdrl: `dgemma.train.sdrl.run_sdrl`

| objective | what a step is | loss |
|---|---|---|
| `ar` | one batch | next-token CE (`dgemma.train.step.ar_loss_fn`) |
| `stage1` | one batch | block-diffusion CE + λ_AR · AR CE (`dgemma.diffusion.stage1`) |
| `sdrl` | one SD·RL iteration (rollouts, teacher, μ inner updates) | (4.2) over recorded states (`dgemma.train.sdrl`) |

Used by `dgemma train`, `dgemma.train.loop.train(cfg)` (which honours `trainer.objective` when no loss is passed),
the planner's compiled check (`dgemma.planning.plan_config`) and the experiments, so the loss a run trains with and
the loss a plan compiles cannot drift apart.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OBJECTIVES", "loss_fn_for"]

OBJECTIVES = ("ar", "stage1", "sdrl")


def loss_fn_for(cfg: Any):
    """The per-batch loss selected by `cfg.trainer.objective` (`ar` or `stage1`).

    `sdrl` has no per-batch loss over data batches (its batches are recorded rollout states built inside each
    iteration): this returns its loss over state rows, `dgemma.train.sdrl.loss.make_sdrl_loss_fn`, which only
    `run_sdrl` can feed.
    """
    objective = cfg.trainer.objective
    if objective == "ar":
        from dgemma.train.step import ar_loss_fn

        return ar_loss_fn
    from dgemma.diffusion.stage1 import Stage1Config, make_stage1_loss_fn

    if objective == "stage1":
        return make_stage1_loss_fn(Stage1Config.from_section(cfg.diffusion))
    if objective == "sdrl":
        from dgemma.train.sdrl.loss import make_sdrl_loss_fn

        return make_sdrl_loss_fn(cfg.sdrl, Stage1Config.from_section(cfg.diffusion))
    raise ValueError(f"trainer.objective={objective!r} is not one of {OBJECTIVES}")
