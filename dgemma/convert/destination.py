"""Where exports and conversions may write: what an existing destination may be replaced by, and cleanup on SIGTERM.

A destination is replaced only when it is the same kind of thing the command writes (a previous export with its
manifest; a params checkpoint root holding only step directories), never when it holds the source being read, and
the replacement is a rename swap (the old one is deleted only after the new one is in place).
"""

from __future__ import annotations

import contextlib
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


def swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`; a previous `out` is renamed aside first and deleted only after the rename
    is durable (the parent directory fsynced)."""
    old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if out.exists():
        os.rename(out, old)
    try:
        os.rename(tmp, out)
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


def write_export_dir(out: Path, fill: Callable[[Path], dict | None], manifest: dict) -> None:
    """Write the export directory `out` atomically: `fill(tmp)` writes the files into a temporary directory beside
    `out` and returns {name: {"bytes", "sha256"}} of those it hashed while writing; every other file is hashed here;
    `EXPORT_MANIFEST` (`manifest` plus the files) is written last, everything fsynced, and the directory swapped into
    place (`swap_into_place`). SIGTERM or any error removes the temporary directory; temp dirs of dead earlier
    writers are removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with sigterm_raises():  # SIGTERM -> exception, so the cleanup below runs
        tmp.mkdir()
        try:
            files = dict(fill(tmp) or {})
            for p in sorted(tmp.iterdir()):
                if p.is_file() and p.name not in files:
                    files[p.name] = {"bytes": p.stat().st_size, "sha256": sha256_file(p, fsync=True)}
            body = {**manifest, "files": dict(sorted(files.items()))}
            (tmp / EXPORT_MANIFEST).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
            sha256_file(tmp / EXPORT_MANIFEST, fsync=True)
            fsync_path(tmp)
            swap_into_place(tmp, out)  # the previous export is removed only after the new one is in place
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
