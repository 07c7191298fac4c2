"""The error that stops a run at a NaN/inf loss or gradient norm (`dgemma train` exits 1 on it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["NonFiniteLossError"]


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm of a step was NaN/inf. Attributes: step, loss, grad_norm, last_checkpoint."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: int | None, directory: Path):
        self.step, self.loss, self.grad_norm, self.last_checkpoint = step, loss, grad_norm, last_checkpoint
        where = (f"the last good checkpoint is step {last_checkpoint} in {directory}" if last_checkpoint is not None
                 else f"no checkpoint was written yet in {directory}")
        super().__init__(f"non-finite loss at step {step} (loss={loss}, grad_norm={grad_norm}); training stopped and "
                         f"this state was NOT saved; {where}")
