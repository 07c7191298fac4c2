"""One training process at a time per run directory and per checkpoint directory: an exclusive, non-blocking `flock`
on each directory itself.

The checkpoint directory is locked too because `checkpoint.dir` may point outside the run directory (and two runs
with different `run.name`s may point at the same one): two trainers there would delete each other's in-progress
saves and interleave steps. The kernel drops a lock when its holder exits (even on SIGKILL), so a stale lock cannot
outlive its process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

__all__ = ["RunDirInUse", "check_free", "run_dir_lock"]


class RunDirInUse(RuntimeError):
    """Another process is training in this run directory (or writes checkpoints to this checkpoint directory)."""


def _try_lock(path: Path, what: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirInUse(f"{what} {path} is in use by another training process; wait for it to finish or choose "
                          f"another run.name / checkpoint.dir") from None
    return fd


def check_free(path: Path, what: str = "run dir") -> None:
    """Raise RunDirInUse now (before any compiling) if an existing `path` is locked; holds nothing."""
    if Path(path).is_dir():
        os.close(_try_lock(Path(path), what))


@contextlib.contextmanager
def run_dir_lock(path: Path, what: str = "run dir") -> Iterator[None]:
    """Hold the lock on the existing directory `path` for the duration of the block."""
    fd = _try_lock(Path(path), what)
    try:
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
