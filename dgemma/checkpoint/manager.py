"""Training-state checkpoints (docs/architecture.md §4). With `params.py` (params-only checkpoints, which use the orbax
plumbing defined here) the only dgemma modules that call orbax.

Layout (one directory per step, written atomically)::

    <checkpoint dir>/<step>/state/            TrainState (params, opt_state, step, rng): OCDBT + zarr3 arrays
                           /data/iterator.json data-iterator state (JSON, see below)
                           /_CHECKPOINT_METADATA  orbax step metadata + dgemma's custom metadata (config sha, ...)
    <run dir>/params/<step>/params/          params only, as a plain nested dict (`params.py`)

API (orbax v0 `CheckpointManager`, the path MaxText uses with `item_names=("state", "data")`; the v1
`ocp.training.Checkpointer` is newer and not thread-safe, and the v0 API is what 0.12.8 documents best):

    with CheckpointManager(dir, keep=3, every=500, every_seconds=3600, metadata={...}) as ckpt:
        if ckpt.should_save(step): ckpt.save(step, state, data_state=it.get_state())
        restored = ckpt.restore(abstract_target)         # latest step, or None if there is none
    # __exit__ waits for the pending async save (also on exceptions), then closes.

Guarantees and choices:
* **Atomic commit.** Orbax writes `<step>.orbax-checkpoint-tmp-<ts>/` and renames it to `<step>/` when every item
  (state AND data) is written; `commit_success.txt` marks it on object stores. A run killed mid-save leaves only a tmp
  directory, which `all_steps`/`latest_step`/`restore` never list and which is removed when a manager is next opened
  (`cleanup_tmp_directories`).
* **Async.** `save` blocks only for the device-to-host copy (so the caller may donate/overwrite the state right after),
  then writes in a background thread. `block_until_ready` runs first so the reported save time is the checkpoint's
  own. `wait_until_finished()` runs before the next save, in `close()`/`__exit__` and at preemption.
* **Existing step** → the save is skipped (no OCDBT collision on resume or on a repeated preemption save).
* **Restore** goes into an abstract target of `jax.ShapeDtypeStruct(shape, dtype, sharding=<current sharding>)`
  leaves (`dgemma.train.state.with_shardings`), so resuming on another topology reshards on load. Call it outside
  `jax.set_mesh` (github.com/google/orbax/issues/3164).
* **Data state.** The data position is a pure function of the step (`DataPipeline.iterator_from_step`) and the
  iterator state is the same on every process (step, grain index, stream fingerprint), so one JSON written by the
  primary host suffices; it is a consistency check on resume, not a crutch.
* **Metadata** per step (`custom_metadata`): dgemma version, step, git sha (best effort), plus the caller's entries
  (config sha, vocab size, canvas length, ...). Read it back with `metadata(step)`.

Faults (`errors.py`), each a one-line error or warning:
* **Corrupt step** (truncated / missing files): `restore()` falls back to the newest intact step, warns naming both,
  and renames each corrupt step to `<step>.corrupt` inside the directory (kept for inspection, never deleted; a later
  save of that step number no longer collides). No intact step left: `CheckpointCorruptError`, nothing renamed.
  Orbax reads lazily, but its tree metadata already reads every array's `zarr.json` from the OCDBT data files, so a
  truncated step fails before any array is allocated.
* **Disk full** (ENOSPC, EDQUOT, EFBIG): `CheckpointWriteError` naming the step and the last good checkpoint, raised
  once (an async save's error surfaces at the next `save` / `wait_until_finished` / `close`); the failed save's
  temporary directory is removed.
* **Noise.** While the manager is open, orbax's and asyncio's own log records about such a failed read or write under
  its directory (a traceback per background thread) and the "Event loop is closed" reports of the operations it
  abandoned are dropped (`errors.OrbaxFaultLogFilter`, `errors.AbandonedIoReports`): the fault is reported once.
* **Changed model / other kind of checkpoint**: the stored tree (paths, shapes, dtypes) is compared with the target
  before anything is read: `CheckpointMismatchError` naming the first differing path (`structure.py`).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax

from dgemma.checkpoint.errors import (
    AbandonedIoReports,
    CheckpointCorruptError,
    CheckpointWriteError,
    OrbaxFaultLogFilter,
    brief,
    disk_full_errno,
    is_corruption,
    release_frames,
)
from dgemma.checkpoint.structure import check_fits

__all__ = ["CheckpointManager", "Restored", "dgemma_metadata"]

log = logging.getLogger(__name__)

STATE = "state"
DATA = "data"
PARAMS = "params"
DATA_FILENAME = "iterator.json"
TMP_MARK = ".orbax-checkpoint-tmp"
"""Orbax writes step N into `N.orbax-checkpoint-tmp[-<timestamp>]/` and renames it to `N/` when complete."""
CORRUPT_SUFFIX = ".corrupt"
RESUME_HINT = ("to start afresh use another run.name (or checkpoint.dir); to start from these params only, set "
               "checkpoint.init_from=<run dir>/params in a new run")


class Restored(NamedTuple):
    """What `CheckpointManager.restore` returns."""

    step: int
    state: Any
    data_state: dict | None
    metadata: dict


@functools.lru_cache(maxsize=1)
def _git_sha() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def dgemma_metadata() -> dict[str, Any]:
    """Provenance recorded with every checkpoint: dgemma version and git sha (None outside a checkout)."""
    try:
        from dgemma import __version__ as version
    except ImportError:  # pragma: no cover
        version = "unknown"
    return {"dgemma_version": version, "git_sha": _git_sha()}


def _ocp():
    import orbax.checkpoint as ocp  # lazy: importing dgemma.checkpoint stays cheap

    return ocp


def _pytree_handler():
    ocp = _ocp()
    return ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)


def _restore_args(target: Any):
    """Restore args from an abstract target whose leaves carry shardings (ShapeDtypeStruct(sharding=...))."""
    ocp = _ocp()
    for leaf in jax.tree.leaves(target):
        if getattr(leaf, "sharding", None) is None:
            raise ValueError("restore target leaves must be jax.ShapeDtypeStruct with a sharding (use "
                             "dgemma.train.state.with_shardings); an unsharded target can OOM or ignore the topology")
    return ocp.checkpoint_utils.construct_restore_args(target)


def _remove_tmp_dirs(directory: Path, step: int) -> None:
    """Remove the temporary directories of a failed save of `step` (written by this process's save: primary only)."""
    if jax.process_index() != 0:
        return
    for tmp in directory.glob(f"{step}{TMP_MARK}*"):
        try:
            shutil.rmtree(tmp)
        except OSError as e:
            log.warning("could not remove the temporary directory %s of the failed save: %s", tmp, brief(e))


def _last_good(step: int | None) -> str:
    return f"step {step}" if step is not None else "none (no committed checkpoint there)"


def _write_error(what: str, directory: Path, code: int, last: int | None, cause: BaseException) -> CheckpointWriteError:
    log.debug("checkpoint write failure", exc_info=cause)
    return CheckpointWriteError(f"no space left writing {what} to {directory}; the last good checkpoint is "
                                f"{_last_good(last)}", errno_code=code)


_PREEMPTION_WARNED: list[bool] = []


def _warn_preemption_service_off(error: Exception) -> None:
    if not _PREEMPTION_WARNED:  # once per process
        _PREEMPTION_WARNED.append(True)
        log.warning("multi-host preemption sync unavailable (%s); preemption saves rely on each process's SIGTERM "
                    "handler", error)


class CheckpointSettings(Protocol):
    """What `CheckpointManager.from_config` reads of the run config's `checkpoint` section
    (`dgemma.config.CheckpointSection`, a layer above)."""

    @property
    def keep(self) -> int: ...
    @property
    def every(self) -> int: ...
    @property
    def every_seconds(self) -> int: ...
    @property
    def async_save(self) -> bool: ...
    def directory(self, run: Any) -> Path: ...


class RunCheckpointSettings(Protocol):
    """The part of a `RunConfig` that `CheckpointManager.from_config` reads: `checkpoint` and `run`."""

    @property
    def checkpoint(self) -> CheckpointSettings: ...
    @property
    def run(self) -> Any: ...


class CheckpointManager:
    """Training-state checkpoints of one run (module docstring).

    Args:
      directory: the checkpoint directory (`cfg.checkpoint.directory(cfg.run)`).
      keep: number of most recent checkpoints to keep.
      every: save when `step % every == 0` (0: only when forced, e.g. at the end or at preemption).
      every_seconds: also save when this many seconds passed since the last save (0: off).
      async_save: write in a background thread.
      metadata: entries recorded in every step's custom metadata (e.g. `{"config_sha": ...}`).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, every: int = 0, every_seconds: float = 0,
                 async_save: bool = True, metadata: Mapping[str, Any] | None = None):
        ocp = _ocp()
        self.directory = Path(directory).absolute()
        self.every, self.every_seconds = int(every), float(every_seconds)
        self._metadata = {**dgemma_metadata(), **dict(metadata or {})}
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self._mgr = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={STATE: _pytree_handler(), DATA: ocp.JsonCheckpointHandler(filename=DATA_FILENAME)},
        )
        self._last_save_time = time.monotonic()
        self.last_save_seconds = 0.0  # blocking time of the most recent save
        self._pending_step: int | None = None  # the step whose save may still fail (async) or is being written
        self._log_filter = OrbaxFaultLogFilter(str(self.directory)).install()
        self._stray_reports = AbandonedIoReports().install()
        self._failed_steps: set[int] = set()  # steps whose save failed: their tmp directories go at close
        self._io_failed = False  # a read or write failed: closing waits for the operations it abandoned (close)

    @classmethod
    def from_config(cls, cfg: RunCheckpointSettings, *, metadata: Mapping[str, Any] | None = None) -> CheckpointManager:
        """From a `RunConfig` (`checkpoint.dir|every|every_seconds|keep|async_save`)."""
        c = cfg.checkpoint
        return cls(c.directory(cfg.run), keep=c.keep, every=c.every, every_seconds=c.every_seconds,
                   async_save=c.async_save, metadata=metadata)

    # MARK: queries ---------------------------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps (tmp directories of interrupted saves are never listed)."""
        return sorted(self._mgr.all_steps())

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def should_save(self, step: int) -> bool:
        """Interval or time policy (the caller forces saves at the end and at preemption)."""
        if self.every and step % self.every == 0:
            return True
        return bool(self.every_seconds) and time.monotonic() - self._last_save_time >= self.every_seconds

    def reached_preemption(self, step: int) -> bool:
        """Multi-host preemption sync point (jax's preemption notice, agreed by all processes). Single process: the
        loop's own SIGTERM handler is the mechanism, so this is False without asking the distributed runtime."""
        if jax.process_count() == 1:
            return False
        try:
            return bool(self._mgr.reached_preemption(step))
        except RuntimeError as e:
            # Expected only when jax's preemption service is off (jax_enable_preemption_service=False): then this sync
            # point cannot fire and the loop's own SIGTERM handling is what saves. Anything else is a real failure.
            if "preemption sync manager" not in str(e).lower():
                raise
            _warn_preemption_service_off(e)
            return False

    def metadata(self, step: int) -> dict:
        """The custom metadata saved with `step`."""
        return dict(self._mgr.metadata(step).custom_metadata or {})

    # MARK: save / restore ----------------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, data_state: Mapping[str, Any] | None = None,
             metadata: Mapping[str, Any] | None = None) -> bool:
        """Save `state` (+ data-iterator JSON) as `step`. Returns False (and writes nothing) if `step` exists.

        Raises:
          CheckpointWriteError: the disk is full, for this save (sync) or the previous one (async).
        """
        ocp = _ocp()
        step = int(step)
        self.wait_until_finished()  # the previous async save's failure surfaces here, attributed to its own step
        if step in self._mgr.all_steps():
            log.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
            return False
        jax.block_until_ready(state)
        t0 = time.monotonic()
        custom = {**self._metadata, **dict(metadata or {}), "step": step}
        self._pending_step = step
        try:
            saved = self._mgr.save(
                step,
                args=ocp.args.Composite(**{
                    STATE: ocp.args.PyTreeSave(state),
                    DATA: ocp.args.JsonSave(dict(data_state) if data_state is not None else {"step": step}),
                }),
                force=True,
                custom_metadata=custom,
            )
        except Exception as e:
            self._save_failed(step, e)
            raise
        self.last_save_seconds = time.monotonic() - t0
        self._last_save_time = time.monotonic()
        log.info("checkpoint step %d: save started in %.2fs (async) -> %s", step, self.last_save_seconds,
                 self.directory)
        return bool(saved)

    def _save_failed(self, step: int, error: Exception) -> None:
        """Clean up after a failed save of `step`; raise CheckpointWriteError for a full disk (else the caller
        re-raises `error`)."""
        self._pending_step = None
        self._io_failed = True
        self._failed_steps.add(step)
        release_frames(error)
        _remove_tmp_dirs(self.directory, step)
        self._mgr.reload()  # orbax lists a step as soon as its save starts
        code = disk_full_errno(error)
        if code is not None:
            raise _write_error(f"step {step}", self.directory, code, self.latest_step(), error) from error

    def restore(self, target: Any, step: int | None = None) -> Restored | None:
        """Restore `step` (default: the newest intact one) into `target` (ShapeDtypeStructs carrying the current
        shardings).

        Returns None when the directory holds no committed checkpoint. Without `step`, corrupt newer steps are renamed
        to `<step>.corrupt` and the newest intact one is restored, with a warning naming both.

        Raises:
          CheckpointMismatchError: the stored tree does not fit `target` (changed model / other kind of checkpoint).
          CheckpointCorruptError: `step` is unreadable, or (no `step`) no intact step is left.
        """
        explicit = step is not None
        candidates = [int(step)] if step is not None else sorted(self.all_steps(), reverse=True)
        if not candidates:
            return None
        restore_args = _restore_args(target)
        corrupt: list[tuple[int, Exception]] = []
        for s in candidates:
            try:
                out, metadata = self._restore_step(s, target, restore_args)
            except Exception as e:
                self._io_failed = True
                release_frames(e)
                if not is_corruption(e):
                    raise
                if explicit:
                    raise CheckpointCorruptError(f"checkpoint step {s} in {self.directory} is unreadable "
                                                 f"({brief(e)})") from e
                corrupt.append((s, e))
                continue
            if corrupt:
                moved = [f"step {c} ({brief(e, 200)}) -> {self._move_aside(c).name}" for c, e in corrupt]
                log.warning("corrupt checkpoint %s in %s, moved aside; resuming from step %d",
                            "; ".join(moved), self.directory, s)
            data_state = out[DATA]
            return Restored(step=s, state=out[STATE], data_state=dict(data_state) if data_state else None,
                            metadata=metadata)
        first, error = corrupt[0]
        raise CheckpointCorruptError(
            f"no intact checkpoint in {self.directory}: step(s) {[c for c, _ in corrupt]} are unreadable "
            f"(step {first}: {brief(error, 200)}); nothing was moved; {RESUME_HINT}") from error

    def _restore_step(self, step: int, target: Any, restore_args: Any) -> tuple[Any, dict]:
        ocp = _ocp()
        # reads every array's zarr.json out of the OCDBT files: a truncated step fails here, before any allocation
        items = self._mgr.item_metadata(step)
        if STATE not in items.keys():
            raise CheckpointCorruptError(f"step {step} has no {STATE!r} item")
        stored = getattr(items[STATE], "tree", None)
        if stored is not None:  # None: a step written without tree metadata; orbax checks while reading
            check_fits(stored, target, what=f"checkpoint step {step} in {self.directory}", hint=RESUME_HINT)
        out = self._mgr.restore(step, args=ocp.args.Composite(**{
            STATE: ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
            DATA: ocp.args.JsonRestore(),
        }))
        return out, self.metadata(step)

    def _move_aside(self, step: int) -> Path:
        """Rename a corrupt step directory to `<step>.corrupt[-i]` (primary process only); returns the new path."""
        src = self.directory / str(step)
        dst = self.directory / f"{step}{CORRUPT_SUFFIX}"
        i = 1
        while dst.exists():
            dst, i = self.directory / f"{step}{CORRUPT_SUFFIX}-{i}", i + 1
        if jax.process_index() == 0:
            os.rename(src, dst)
        if jax.process_count() > 1:  # every process must stop listing the step before any of them saves it again
            _ocp().multihost.sync_global_processes(f"dgemma_checkpoint_moved_aside_{step}")
        self._mgr.reload()
        return dst

    # MARK: lifecycle ---------------------------------------------------------------------------------------------
    def wait_until_finished(self) -> None:
        """Block until the pending async save is committed.

        Raises:
          CheckpointWriteError: it failed for a full disk (raised once; its temporary directory is removed).
        """
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            if self._pending_step is None:
                raise
            self._save_failed(self._pending_step, e)
            raise
        self._pending_step = None

    def close(self) -> None:
        """Wait for pending saves, then release orbax resources. Idempotent."""
        if self._mgr is None:
            return
        try:
            self.wait_until_finished()
        finally:
            self._mgr.close()
            self._mgr = None
            # Orbax's other writer threads of a failed save can still create files after the first error surfaced
            # (seen under load): once closed, nothing writes any more, so remove what they left.
            for step in sorted(self._failed_steps):
                _remove_tmp_dirs(self.directory, step)
            if self._io_failed:
                self._stray_reports.drain()
            self._log_filter.remove()
            self._stray_reports.remove()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
