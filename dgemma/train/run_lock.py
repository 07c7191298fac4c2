"""One process at a time per run directory: an exclusive, non-blocking `flock` on the directory itself.

The kernel drops the lock when the holder exits (even on SIGKILL), so a stale lock cannot outlive its process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


class RunDirInUse(RuntimeError):
    """Another process is training in this run directory."""


def _try_lock(run_dir: Path) -> int:
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirInUse(f"{run_dir} is in use by another training process; wait for it to finish or choose "
                          f"another run.name") from None
    return fd


def check_free(run_dir: Path) -> None:
    """Raise RunDirInUse now (before any compiling) if an existing `run_dir` is locked; holds nothing."""
    if Path(run_dir).is_dir():
        os.close(_try_lock(Path(run_dir)))


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold the lock on the existing `run_dir` for the duration of the block."""
    fd = _try_lock(Path(run_dir))
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
