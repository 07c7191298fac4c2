"""What a training run returns (`dgemma.train.trainer.train`; SD·RL adds its history, `SDRLSummary`)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["TrainSummary"]


@dataclasses.dataclass
class TrainSummary:
    """What `train` returns."""

    run_dir: str
    config_sha: str
    start_step: int  # the step training started from (restored checkpoint step, or 0)
    final_step: int  # the state's step at return
    steps_run: int
    preempted: bool
    last_metrics: dict[str, float]
    checkpoint_steps: list[int]  # committed checkpoints at return
    wall_seconds: float
    compile_seconds: float = 0.0
    resumed: bool = False
    state: Any = dataclasses.field(default=None, repr=False)  # the final TrainState (on device)
