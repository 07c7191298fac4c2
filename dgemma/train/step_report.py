"""A trainer step's metrics on the host: timing, the non-finite check, and where they go (tracker, progress bar,
`on_step`). Owned by `dgemma.train.trainer.train_loop`.

Step time and tokens per second are measured between two reads of the host metrics; the seconds spent evaluating or
checkpointing are taken out (`exclude`), so `step_time` is the trainer step's own time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax

from dgemma.train.nonfinite import NonFiniteLossError

__all__ = ["StepReport"]


class StepReport:
    """Reads (`read`) and reports (`report`) one step's metrics (module docstring)."""

    def __init__(self, *, start: int, total: int, t_start: float, log_every: int, progress_metrics: tuple[str, ...],
                 tracker: Any, ckpt: Any, bar: Any | None, on_step: Callable[[int, dict[str, float]], None] | None,
                 process_index: int):
        self.total, self.t_start, self.log_every = total, t_start, log_every
        self.progress_metrics = progress_metrics
        self.tracker, self.ckpt, self.bar, self.on_step = tracker, ckpt, bar, on_step
        self.lead = process_index == 0
        self.t_last, self.step_last = time.time(), start  # the previous read
        self.last_metrics: dict[str, float] = {}

    def exclude(self, seconds: float) -> None:
        """Take `seconds` (an evaluation, a checkpoint save) out of the step time."""
        self.t_last += seconds

    def read(self, step: int, out: Any) -> dict[str, float]:
        """A step's metrics (`StepOutput`) on the host (blocks until it ran); a non-finite step is logged, then
        raises `NonFiniteLossError`."""
        host = {k: float(v) for k, v in jax.device_get(out.metrics).items()}
        now = time.time()
        dt = max(now - self.t_last, 1e-9)
        n = max(step - self.step_last, 1)
        self.t_last, self.step_last = now, step
        host.update(step_time=dt / n, tokens_per_sec=out.tokens * n / dt, time=now, elapsed=now - self.t_start)
        finite = out.finite if out.finite is not None else (
            math.isfinite(host.get("loss", 0.0)) and math.isfinite(host.get("grad_norm", 0.0)))
        if not finite:
            if self.lead:
                self.tracker.log(step, {**host, "nonfinite": 1.0})
            self.ckpt.wait_until_finished()
            raise NonFiniteLossError(step, host.get("loss", math.nan), host.get("grad_norm", math.nan),
                                     self.ckpt.latest_step(), self.ckpt.directory)
        return host

    def report(self, step: int, host: dict[str, float], evaluated: bool) -> None:
        """Log `host` (every `trainer.log_every` steps, the last one and evaluated ones), advance the bar, call
        `on_step`."""
        self.last_metrics = host
        if self.lead and (evaluated or step % self.log_every == 0 or step == self.total):
            self.tracker.log(step, host)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix({k: f"{host[k]:.4g}" for k in self.progress_metrics if k in host}, refresh=False)
        if self.on_step is not None and self.lead:
            self.on_step(step, host)
