"""The training objective selected by `trainer.objective`: one place that maps a config to its loss function.

    loss_fn = loss_fn_for(cfg)      # LossFn for dgemma.train.step.make_train_step / dgemma.train.loop.train

Used by `dgemma train`, the planner's compiled check (`dgemma.planning.plan_config`) and the experiments, so the
loss a run trains with and the loss a plan compiles cannot drift apart.
"""

from __future__ import annotations

from typing import Any

__all__ = ["loss_fn_for"]


def loss_fn_for(cfg: Any):
    """The loss selected by `cfg.trainer.objective` (`ar`, or the stage-1 block-diffusion loss)."""
    if cfg.trainer.objective == "ar":
        from dgemma.train.step import ar_loss_fn

        return ar_loss_fn
    from dgemma.diffusion.stage1 import Stage1Config, make_stage1_loss_fn

    return make_stage1_loss_fn(Stage1Config.from_section(cfg.diffusion))
