"""One training process at a time per run directory and per checkpoint directory: an exclusive, non-blocking `flock`
on each directory itself.

The checkpoint directory is locked too because `checkpoint.dir` may point outside the run directory (and two runs
with different `run.name`s may point at the same one): two trainers there would delete each other's in-progress
saves and interleave steps. The kernel drops a lock when its holder exits (even on SIGKILL), so a stale lock cannot
outlive its process.

The trainer takes them first (`RunLocks.take_existing`, before the data, the model, the compile and before anything is
written): a second run on a directory in use is refused in one line at once and leaves nothing behind. A run directory
that does not exist yet is locked as soon as it is created (`RunLocks.take_rest`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any, Iterator

__all__ = ["RunDirInUse", "RunLocks", "check_free", "run_dir_lock"]


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


class RunLocks:
    """The locks of one training run on its run directory and its checkpoint directory (module docstring); held until
    `release`. Only process 0 of a run takes them."""

    def __init__(self, run_dir: Path, ckpt_dir: Path):
        self.run_dir, self.ckpt_dir = Path(run_dir), Path(ckpt_dir)
        self.own_ckpt_lock = self.ckpt_dir != self.run_dir  # (a second flock on one directory would refuse this run)
        self.fds: dict[Path, int] = {}
        self.created: list[Path] = []  # directories made by `take_existing`, removed again if the start fails

    @classmethod
    def for_config(cls, cfg: Any) -> RunLocks:
        """The locks of `cfg.run.run_dir` and `cfg.checkpoint`'s directory (absolute paths)."""
        return cls(Path(cfg.run.run_dir).absolute(), Path(cfg.checkpoint.directory(cfg.run)).absolute())

    def check_free(self) -> None:
        """Raise RunDirInUse now if either existing directory is locked by another process; holds nothing."""
        check_free(self.run_dir, "run dir")
        if self.own_ckpt_lock:
            check_free(self.ckpt_dir, "checkpoint.dir")

    def _lock(self, path: Path, what: str) -> None:
        if path not in self.fds:
            self.fds[path] = _try_lock(path, what)

    def take_existing(self) -> None:
        """Lock the directories that exist now; a checkpoint directory outside the run directory is created first
        (so two runs starting on one `checkpoint.dir` exclude each other from the start)."""
        try:
            if self.run_dir.is_dir():
                self._lock(self.run_dir, "run dir")
            if self.own_ckpt_lock:
                if not self.ckpt_dir.is_dir() and not self.ckpt_dir.is_relative_to(self.run_dir):
                    missing = [p for p in (self.ckpt_dir, *self.ckpt_dir.parents) if not p.exists()]
                    self.ckpt_dir.mkdir(parents=True, exist_ok=True)
                    self.created = missing  # deepest first
                if self.ckpt_dir.is_dir():
                    self._lock(self.ckpt_dir, "checkpoint.dir")
        except BaseException:
            self.release(started=False)
            raise

    def take_rest(self) -> None:
        """Lock what `take_existing` could not: the run directory (now created) and a checkpoint directory inside it."""
        self._lock(self.run_dir, "run dir")
        if self.own_ckpt_lock:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            self._lock(self.ckpt_dir, "checkpoint.dir")

    def release(self, *, started: bool = True) -> None:
        """Drop the locks; a run that did not start also removes the (still empty) directories it created."""
        for fd in self.fds.values():
            os.close(fd)  # closing the descriptor releases the lock
        self.fds.clear()
        if not started:
            for path in self.created:
                try:
                    path.rmdir()  # only if empty: nothing of another run is ever removed
                except OSError:
                    break
        self.created = []
