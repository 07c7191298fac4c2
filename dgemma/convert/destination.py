"""Where exports and conversions may write: what an existing destination may be replaced by, and cleanup on SIGTERM.

A destination is replaced only when it is the same kind of thing the command writes (a previous export with its
manifest; a params checkpoint root holding only step directories), never when it holds the source being read, and
the replacement is a rename swap (the old one is deleted only after the new one is in place).

Concurrent writers of one destination: an export holds `.<name>.lock` beside it (an exclusive `flock`, released by the
kernel when its process dies) from its final destination check to its publication, so a second export of the same
`out` is refused in one line instead of both claiming success; a new destination is published with a rename that
never replaces (`rename_noreplace`: `renameat2(RENAME_NOREPLACE)`; on Linux a plain rename of a directory onto an
existing empty one succeeds). A full disk is reported in one line naming the destination and the file being written.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import hashlib
import json
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator

import psutil

EXPORT_MANIFEST = "dgemma_manifest.json"
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1  # <fcntl.h>, <linux/fs.h>


def _inside(path: Path, root: Path) -> bool:
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def check_destination(out, *, overwrite: bool, kind: str, sources: Iterable = ()) -> None:
    """Raise FileExistsError (one line, naming `out`) unless writing `out` may proceed.

    kind: "export" (an existing `out` must be a previous export: a directory with its manifest) or "params" (an
    existing `out` must be a params checkpoint root: only step directories). `sources` (the input paths) may not lie
    inside `out`, whatever `overwrite` says.
    """
    out = Path(out)
    for src in sources:
        if src is not None and Path(src).exists() and _inside(Path(src), out):
            raise FileExistsError(f"{out}: refusing to write here, it contains the source {src}")
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and kind == "params" and not any(out.iterdir()):
        return  # an empty directory (e.g. made by hand) is not data
    if not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite (overwrite=True) to replace it")
    if kind == "export":
        if not (out.is_dir() and (out / EXPORT_MANIFEST).is_file()):
            raise FileExistsError(f"{out}: --overwrite replaces only a previous export (a directory with "
                                  f"{EXPORT_MANIFEST}); this is something else, refusing to delete it")
    elif kind == "params":
        others = sorted(p.name for p in out.iterdir() if not (p.is_dir() and p.name.isdigit()))
        if not out.is_dir() or others:
            raise FileExistsError(f"{out}: --overwrite replaces only a params checkpoint (step directories); it "
                                  f"also holds {others[:5]}, refusing to delete it")
    else:
        raise ValueError(f"check_destination: unknown kind {kind!r}")


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`, atomically refusing (FileExistsError) when `dst` exists, even as an empty directory.
    Where the kernel or filesystem lacks `renameat2(RENAME_NOREPLACE)`, a check before the rename (racy)."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is not None:
        if rename(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), str(src), None, str(dst))  # EEXIST: a FileExistsError
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(src), None, str(dst))
    os.rename(src, dst)


def swap_into_place(tmp: Path, out: Path, *, replace: bool = True) -> None:
    """Rename the finished `tmp` to `out`; with `replace`, a previous `out` is renamed aside first and deleted only
    after the rename is durable (the parent directory fsynced). The rename itself never replaces: an `out` that
    exists then (another writer's, even an empty directory) is a FileExistsError naming `out`."""
    old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if replace and out.exists():
        os.rename(out, old)
    try:
        try:
            rename_noreplace(tmp, out)
        except FileExistsError:
            raise FileExistsError(f"{out} appeared while this write was in progress (another writer); refusing "
                                  f"to replace it") from None
    except BaseException:
        if old.exists():
            os.rename(old, out)
        raise
    fsync_path(out.parent)
    shutil.rmtree(old, ignore_errors=True)


class Terminated(SystemExit):
    """SIGTERM arrived while a destination was being written (exit status 143, like the default action)."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` (so `except BaseException` cleanup runs) instead of killing the
    process outright; the previous handler is restored afterwards. No-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sha256_file(path: Path, fsync: bool = False) -> str:
    """The sha256 of a file's bytes (read in 4 MiB chunks); `fsync` also makes the file durable."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def remove_stale(out: Path) -> None:
    """Delete temp/old dirs of earlier writes to `out` whose process is gone (e.g. SIGKILLed mid-write)."""
    for p in out.parent.glob(f".{glob.escape(out.name)}.*-*-*"):
        kind, _, rest = p.name[len(out.name) + 2:].partition("-")
        pid = rest.split("-")[0]
        if kind in ("tmp", "old") and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def claim_destination(out: Path, what: str = "export") -> Iterator[None]:
    """Hold `out` for this writer alone: an exclusive, non-blocking `flock` on `.<name>.lock` beside it, removed
    when the block ends (the kernel releases it if the process dies). Another holder: FileExistsError naming `out`."""
    lock = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise FileExistsError(f"{out}: another {what}{f' (pid {holder})' if holder else ''} is writing it now; "
                                  f"refusing to write there too") from None
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the previous holder removed this lock file after it was opened: claim the current one
    try:
        os.ftruncate(fd, 0)  # a killed holder's pid may still be in it
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # while still holding it, so that nobody holds a removed file
        os.close(fd)


class ExportWriteError(OSError):
    """An export could not be written (disk full / quota / file size limit); nothing was left at the destination."""

    def __init__(self, message: str, *, errno_code: int | None = None):
        super().__init__(message)
        self.errno = errno_code


def _disk_full(e: OSError, out: Path) -> ExportWriteError:
    """A one-line error for a full disk (or quota, or file size limit) naming `out` and the file being written."""
    name = Path(e.filename).name if e.filename else "its files"
    assert e.errno is not None  # the caller matched it against DISK_FULL_ERRNOS
    return ExportWriteError(f"{out}: {os.strerror(e.errno).lower()} while writing {name}; nothing was written "
                            f"there", errno_code=e.errno)


def write_export_dir(out: Path, fill: Callable[[Path], dict | None], manifest: dict, *, overwrite: bool = False,
                     sources: Iterable = ()) -> None:
    """Write the export directory `out` atomically: `fill(tmp)` writes the files into a temporary directory beside
    `out` and returns {name: {"bytes", "sha256"}} of those it hashed while writing; every other file is hashed here;
    `EXPORT_MANIFEST` (`manifest` plus the files) is written last, everything fsynced, and the directory swapped into
    place (`swap_into_place`). The destination is claimed (`claim_destination`) and checked again
    (`check_destination` with `overwrite`, `sources`) for the whole write. SIGTERM or any error removes the temporary
    directory; temp dirs of dead earlier writers are removed first; a full disk is an OSError naming `out` and the
    file (`_disk_full`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with claim_destination(out), sigterm_raises():  # SIGTERM -> exception, so the cleanup below runs
        check_destination(out, overwrite=overwrite, kind="export", sources=sources)  # another export may have won
        remove_stale(out)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        _fill_and_publish(out, tmp, fill, manifest, replace=overwrite)


def _fill_and_publish(out: Path, tmp: Path, fill: Callable[[Path], dict | None], manifest: dict, *,
                      replace: bool) -> None:
    try:
        tmp.mkdir()
        files = dict(fill(tmp) or {})
        for p in sorted(tmp.iterdir()):
            if p.is_file() and p.name not in files:
                files[p.name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p, fsync=True)}
        body = {**manifest, "files": dict(sorted(files.items()))}
        (tmp / EXPORT_MANIFEST).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        sha256_file(tmp / EXPORT_MANIFEST, fsync=True)
        fsync_path(tmp)
        swap_into_place(tmp, out, replace=replace)  # a previous export is removed only after the new one is in place
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            raise _disk_full(e, out) from e
        raise
