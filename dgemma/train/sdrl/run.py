"""`run_sdrl(cfg) -> SDRLSummary`: the one trainer on `trainer.objective=sdrl` (`SDRLSession`), with every
iteration's metrics in the summary's `history`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dgemma.train.summary import TrainSummary

__all__ = ["SDRLSummary", "run_sdrl"]


@dataclasses.dataclass
class SDRLSummary(TrainSummary):
    """`TrainSummary` (steps = iterations) + `history`: the metrics dict of every iteration run in this call."""

    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    max_steps: int = 0  # the student's K_max at return


def run_sdrl(cfg: Any, *, data: Any | None = None, model_factory=None, mesh=None, progress: bool = True,
             on_iteration: Callable[[int, dict[str, float]], None] | None = None,
             eval_data: Any | None = None) -> SDRLSummary:
    """Run `cfg.trainer.steps` SD·RL iterations with the one trainer (`dgemma.train.trainer.train`) from
    `checkpoint.init_from`, resuming from the run's latest checkpoint if there is one. Returns the summary with
    every iteration's metrics in `history`. Bad settings raise a one-line error naming the setting before anything
    is written.

    Every `trainer.eval_every` iterations (and at the last) the metrics add `dgemma.train.sdrl.evaluation.evaluate`'s
    scores over `trainer.eval_batches` batches of `eval_data` (a `dgemma.eval.heldout.HeldOutSet`, or any
    pipeline-like object; default: prompts of the data config's task mix deduplicated against every prompt this run
    trains on, or for a file source the rows of `data.eval_paths`, refused when they share a prompt with
    `data.paths`) and, for a `HeldOutSet`, `eval/heldout_overlap` (0)."""
    from dgemma.train.objectives import get_objective
    from dgemma.train.trainer import train

    objective = get_objective(cfg.trainer.objective)
    if not objective.rollouts:
        raise ValueError(f"run_sdrl: trainer.objective={cfg.trainer.objective}, not an SD·RL objective")
    history: list[dict[str, float]] = []

    def record(step: int, metrics: dict[str, float]) -> None:
        history.append(metrics)
        if on_iteration is not None:
            on_iteration(step, metrics)

    summary, session = train(cfg, data=data, model_factory=model_factory, mesh=mesh, progress=progress,
                             on_step=record, return_session=True, eval_data=eval_data)
    fields = {f.name: getattr(summary, f.name) for f in dataclasses.fields(TrainSummary)}
    return SDRLSummary(**fields, history=history, max_steps=session.curriculum.max_steps)
