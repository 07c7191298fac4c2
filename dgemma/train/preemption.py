"""Graceful preemption: SIGTERM/SIGINT set a flag; the training loop saves at the next step boundary and returns.

    with PreemptionGuard() as guard:
        for step in ...:
            ...
            if guard.triggered: save(step); break

A second SIGINT while the flag is already set raises `KeyboardInterrupt` (an impatient Ctrl-C still stops the process;
the loop's `finally` still waits for a pending async checkpoint). Handlers are installed only in the main thread (Python
allows nothing else) and the previous handlers are restored on exit.

Multi-process runs must agree on the step to save at: `any_process(flag)` all-gathers the local flag (a tiny
collective); the orbax/jax preemption sync point (`CheckpointManager.reached_preemption`) covers the cluster's own
preemption notices.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["PreemptionGuard", "any_process"]

log = logging.getLogger(__name__)


class PreemptionGuard:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self.triggered = False
        self.signum: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.triggered and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.triggered = True
        self.signum = signum
        log.warning("received %s: saving a checkpoint at the next step boundary, then stopping",
                    signal.Signals(signum).name)

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.getsignal(s)
                signal.signal(s, self._handle)
        else:
            log.warning("not in the main thread: SIGTERM/SIGINT preemption handlers are not installed")
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def any_process(flag: bool) -> bool:
    """True if `flag` is set on any process (identity for a single process)."""
    import jax

    if jax.process_count() == 1:
        return bool(flag)
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, dtype=np.int32))))
