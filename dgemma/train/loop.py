"""Entry points of training: `train(cfg, ...)` and `run_objective(cfg, ...)`, both the one trainer of
`dgemma.train.trainer` (which owns the loop: startup, resume, logging, evaluation, checkpoints, preemption).

    summary = train(cfg)                                  # the objective of cfg.trainer.objective
    summary = train(cfg, loss_fn=my_loss, data=..., model_factory=...)   # a one-batch objective with a custom loss
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh

from dgemma.train.nonfinite import NonFiniteLossError  # noqa: F401  (re-exported)
from dgemma.train.run_dir import prepare_run_dir, record_config  # noqa: F401  (re-exported)
from dgemma.train.summary import TrainSummary

__all__ = ["NonFiniteLossError", "TrainSummary", "prepare_run_dir", "run_objective", "train"]


def train(
    cfg: Any,
    *,
    data: Any | None = None,
    loss_fn: Callable | None = None,
    model_factory: Callable | None = None,
    mesh: Mesh | None = None,
    progress: bool = True,
    save_params_at_end: bool = True,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    **session_kwargs: Any,
) -> TrainSummary:
    """Train `cfg.trainer.steps` steps of `cfg.trainer.objective` (`dgemma.train.trainer.run_training`).

    Args:
      loss_fn: `loss_fn(model, batch, rng) -> (loss, aux)` replacing the objective's loss (ar / stage1 only).
      data, model_factory, mesh, progress, save_params_at_end, on_step: `run_training`'s.
      session_kwargs: the objective session's own arguments (sdrl: `eval_data`).

    Raises:
      NonFiniteLossError: a step produced a NaN/inf loss or grad norm (that state is not saved).
    """
    from dgemma.train.trainer import run_training

    if loss_fn is not None:  # the objective's session refuses it where its update is not a loss over batches
        session_kwargs["loss_fn"] = loss_fn
    summary, _ = run_training(cfg, data=data, model_factory=model_factory, mesh=mesh, progress=progress,
                              save_params_at_end=save_params_at_end, on_step=on_step,
                              session_kwargs=session_kwargs)
    return summary


def run_objective(cfg: Any, **kwargs: Any) -> TrainSummary:
    """Train `cfg` with its `trainer.objective` (`train`); returns the `TrainSummary`."""
    return train(cfg, **kwargs)
