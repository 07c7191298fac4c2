"""Checkpoint faults: the exceptions dgemma raises for them and how orbax's own errors are classified.

* `CheckpointWriteError` (an OSError): a save failed because the disk is full (ENOSPC), the quota is used up
  (EDQUOT) or a file hit the size limit (EFBIG). Raised once, in one line, naming the step, the directory and the last
  good checkpoint; the failed save's temporary directory is removed.
* `CheckpointCorruptError` (a ValueError): a committed step cannot be read (truncated or missing files). The
  manager falls back to the newest intact step; this is raised when none is left, or for an explicit step.
* `CheckpointMismatchError` (a ValueError): the stored tree does not fit the restore target (another model, another
  optimizer, another kind of checkpoint). Raised before orbax reads any array (`structure.py`).

Orbax reports storage errors as the exceptions of tensorstore (a ValueError whose text starts with an absl status
code and carries `[os_error_code='28']`) or of Python's file API, so both the type and the text are inspected.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import re
import sys
import time
import traceback
from collections.abc import Callable

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_DISK_FULL_TEXT = ("no space left on device", "disk quota exceeded", "file too large")
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
# tensorstore status codes meaning "the stored bytes are not what was written": a truncated file (OUT_OF_RANGE: a
# byte range past its end), a removed one (NOT_FOUND), a damaged one (DATA_LOSS: checksum or decoding). Transient or
# environmental codes (RESOURCE_EXHAUSTED, UNAVAILABLE, PERMISSION_DENIED, ...) are deliberately absent: a step that
# failed to load for those reasons is intact and must not be moved aside.
_CORRUPT_STATUS = ("OUT_OF_RANGE", "NOT_FOUND", "DATA_LOSS")
MAX_DETAIL = 300
"""Characters of an underlying error quoted in a one-line message (tensorstore errors embed whole specs)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full / quota / file size limit); the last good one is intact."""

    def __init__(self, message: str, *, errno_code: int | None = None):
        super().__init__(message)
        self.errno = errno_code


class CheckpointCorruptError(ValueError):
    """A committed checkpoint step cannot be read back."""


class CheckpointMismatchError(ValueError):
    """The stored checkpoint tree does not fit the restore target."""


def _chain(error: BaseException):
    """The error, its causes / contexts (and the members of exception groups), each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend([e.__cause__, e.__context__, *getattr(e, "exceptions", ())])


def disk_full_errno(error: BaseException) -> int | None:
    """ENOSPC / EDQUOT / EFBIG if `error` (or what caused it) is one of them, else None."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e.errno
        text = str(e)
        for match in _OS_ERROR_CODE.finditer(text):
            if int(match.group(1)) in DISK_FULL_ERRNOS:
                return int(match.group(1))
        lowered = text.lower()
        for code, needle in zip((errno.ENOSPC, errno.EDQUOT, errno.EFBIG), _DISK_FULL_TEXT):
            if needle in lowered:
                return code
    return None


def is_corruption(error: BaseException) -> bool:
    """Whether reading a committed step failed because its files are damaged or missing (not for a transient or
    environmental reason, and not because the target does not fit: that is `CheckpointMismatchError`)."""
    if isinstance(error, CheckpointMismatchError):
        return False
    for e in _chain(error):
        if isinstance(e, CheckpointCorruptError):
            return True
        if isinstance(e, MemoryError | PermissionError):
            return False
        if isinstance(e, json.JSONDecodeError | FileNotFoundError | UnicodeDecodeError | EOFError):
            return True
        if isinstance(e, KeyError) and "not found in the checkpoint" in str(e):  # an item directory is gone
            return True
        if isinstance(e, ValueError | RuntimeError | OSError):
            text = str(e).lstrip()
            if any(text.startswith(f"{code}:") for code in _CORRUPT_STATUS):
                return True
    return False


def release_frames(error: BaseException) -> None:
    """Clear the local variables of the finished frames in the tracebacks of `error` and its causes: orbax's frames
    hold the tasks and futures of the operations a failure abandoned, and those log "exception was never retrieved"
    when they are freed. Freed now, they are freed while the manager's filters are installed, not whenever the error
    reporting the fault is (after the manager closed). The tracebacks themselves (files, lines) stay."""
    for e in _chain(error):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)


def brief(error: BaseException, limit: int = MAX_DETAIL) -> str:
    """`Type: message` of an error on one line, cut to `limit` characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


class OrbaxFaultLogFilter(logging.Filter):
    """Drops the log records orbax and asyncio write about a failed read or write under `directory` (a full disk, a
    damaged file): multi-page tracebacks, one per background thread or abandoned future, for a fault the manager
    reports itself in one line. Installed on the "absl" (orbax logs through absl) and "asyncio" loggers for a scope (a
    manager's lifetime, one `save_params` call) and removed after it; records about anything else pass."""

    LOGGERS = ("absl", "asyncio")

    def __init__(self, directory: str):
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        error = record.exc_info[1] if record.exc_info else None
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to judge
            return True
        if error is not None:
            text = f"{text} {error}"
        if self.directory not in text:
            return True
        if error is not None and (disk_full_errno(error) is not None or is_corruption(error)):
            return False
        return disk_full_errno(Exception(text)) is None and not any(f"{c}:" in text for c in _CORRUPT_STATUS)

    def install(self) -> OrbaxFaultLogFilter:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def remove(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


class AbandonedIoReports:
    """Drops Python's "Exception ignored ... RuntimeError: Event loop is closed" reports that follow a failed read or
    write.

    Orbax reads and writes a checkpoint through many concurrent tensorstore operations inside `asyncio.run`; when one
    fails (a truncated file, a full disk), the loop is closed while the others are still in flight, and each of them
    then calls back into the closed loop from a tensorstore thread: one multi-line traceback per array on stderr,
    after dgemma already reported the fault in one line. Installed as `sys.unraisablehook` for a scope (a manager's
    lifetime, one `save_params` / `restore_params` call) and removed after it (after `settle` when something failed);
    every other report goes to the previous hook.
    """

    def __init__(self):
        self._previous: Callable[[sys.UnraisableHookArgs], object] | None = None
        self._active = False
        self._last_dropped = 0.0

    def __call__(self, unraisable) -> None:
        exc = unraisable.exc_value
        if self._active and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            self._last_dropped = time.monotonic()
            return
        (self._previous or sys.__unraisablehook__)(unraisable)

    def install(self) -> AbandonedIoReports:
        self._previous, self._active = sys.unraisablehook, True
        sys.unraisablehook = self
        return self

    def settle(self, quiet: float = 0.2, limit: float = 2.0) -> None:
        """After a failure: wait until the abandoned operations stopped reporting (`quiet` seconds without one; they
        finish within milliseconds on a local disk), at most `limit` seconds, so that they are dropped before
        `remove`."""
        start = time.monotonic()
        self._last_dropped = max(self._last_dropped, start)
        while time.monotonic() - self._last_dropped < quiet and time.monotonic() - start < limit:
            time.sleep(quiet / 5)

    def drain(self) -> None:
        """After a failure: `settle`, then collect the futures the failed operation abandoned, whose "exception was
        never retrieved" log records `OrbaxFaultLogFilter` drops while it is still installed."""
        self.settle()
        gc.collect()

    def remove(self) -> None:
        self._active = False  # if another hook wrapped this one meanwhile, stay in the chain as a pass-through
        if sys.unraisablehook is self:
            assert self._previous is not None  # only install() makes this object the hook, and it sets _previous
            sys.unraisablehook = self._previous
