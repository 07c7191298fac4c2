"""Checkpoints: the ONLY dgemma module that calls orbax (framework.md §6).

Layout (one directory per step, written atomically)::

    <checkpoint dir>/<step>/state/            TrainState (params, opt_state, step, rng): OCDBT + zarr3 arrays
                           /data/iterator.json data-iterator state (JSON, see below)
                           /_CHECKPOINT_METADATA  orbax step metadata + dgemma's custom metadata (config sha, ...)
    <run dir>/params/<step>/params/          params only, as a plain nested dict (evaluation / export / init_from)

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
  `jax.set_mesh` (orbax #3164).
* **Data state.** The data position is a pure function of the step (`DataPipeline.iterator_from_step`) and the
  iterator state is the same on every process (step, grain index, stream fingerprint), so one JSON written by the
  primary host suffices; it is a consistency check on resume, not a crutch.
* **Metadata** per step (`custom_metadata`): dgemma version, step, git sha (best effort), plus the caller's entries
  (config sha, vocab size, canvas length, ...). Read it back with `metadata(step)`.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax

__all__ = ["CheckpointManager", "Restored", "dgemma_metadata", "restore_params", "save_params"]

log = logging.getLogger(__name__)

STATE = "state"
DATA = "data"
PARAMS = "params"
DATA_FILENAME = "iterator.json"


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


_PREEMPTION_WARNED: list[bool] = []


def _warn_preemption_service_off(error: Exception) -> None:
    if not _PREEMPTION_WARNED:  # once per process
        _PREEMPTION_WARNED.append(True)
        log.warning("multi-host preemption sync unavailable (%s); preemption saves rely on each process's SIGTERM "
                    "handler", error)


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

    @classmethod
    def from_config(cls, cfg: Any, *, metadata: Mapping[str, Any] | None = None) -> CheckpointManager:
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
        """Save `state` (+ data-iterator JSON) as `step`. Returns False (and writes nothing) if `step` exists."""
        ocp = _ocp()
        step = int(step)
        if step in self._mgr.all_steps():
            log.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
            return False
        jax.block_until_ready(state)
        t0 = time.monotonic()
        custom = {**self._metadata, **dict(metadata or {}), "step": step}
        saved = self._mgr.save(
            step,
            args=ocp.args.Composite(**{
                STATE: ocp.args.PyTreeSave(state),
                DATA: ocp.args.JsonSave(dict(data_state) if data_state is not None else {"step": step}),
            }),
            force=True,
            custom_metadata=custom,
        )
        self.last_save_seconds = time.monotonic() - t0
        self._last_save_time = time.monotonic()
        log.info("checkpoint step %d: save started in %.2fs (async) -> %s", step, self.last_save_seconds,
                 self.directory)
        return bool(saved)

    def restore(self, target: Any, step: int | None = None) -> Restored | None:
        """Restore `step` (default: latest) into `target` (ShapeDtypeStructs carrying the current shardings).

        Returns None when the directory holds no committed checkpoint.
        """
        ocp = _ocp()
        step = self.latest_step() if step is None else int(step)
        if step is None:
            return None
        out = self._mgr.restore(step, args=ocp.args.Composite(**{
            STATE: ocp.args.PyTreeRestore(item=target, restore_args=_restore_args(target)),
            DATA: ocp.args.JsonRestore(),
        }))
        data_state = out[DATA]
        return Restored(step=step, state=out[STATE], data_state=dict(data_state) if data_state else None,
                        metadata=self.metadata(step))

    # MARK: lifecycle ---------------------------------------------------------------------------------------------
    def wait_until_finished(self) -> None:
        """Block until the pending async save is committed (raises its error, if any)."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves, then release orbax resources. Idempotent."""
        if self._mgr is None:
            return
        try:
            self._mgr.wait_until_finished()
        finally:
            self._mgr.close()
            self._mgr = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# MARK: params-only checkpoints --------------------------------------------------------------------------------------
def _to_pure(params: Any) -> Any:
    to_pure = getattr(params, "to_pure_dict", None)
    return to_pure() if to_pure is not None else params


def save_params(directory: str | os.PathLike, step: int, params: Any, *,
                metadata: Mapping[str, Any] | None = None) -> Path:
    """Write params only (an `nnx.State` is stored as its plain nested dict) to `<directory>/<step>/`, atomically
    and synchronously. Skips an existing step. Returns the step directory."""
    ocp = _ocp()
    directory = Path(directory).absolute()
    custom = {**dgemma_metadata(), **dict(metadata or {}), "step": int(step)}
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False, cleanup_tmp_directories=True),
            item_handlers={PARAMS: _pytree_handler()}) as mgr:
        if int(step) not in mgr.all_steps():
            mgr.save(int(step), args=ocp.args.Composite(**{PARAMS: ocp.args.PyTreeSave(_to_pure(params))}),
                     force=True, custom_metadata=custom)
            mgr.wait_until_finished()
    return directory / str(int(step))


def restore_params(path: str | os.PathLike, target: Any) -> Any:
    """Restore params written by `save_params` into `target`.

    Args:
      path: the params root (`<run dir>/params`, latest step is used) or one step directory in it.
      target: an `nnx.State` of ShapeDtypeStructs with shardings (or a plain nested dict of them); the result has the
        same type, holding arrays on the target's shardings.
    """
    ocp = _ocp()
    path = Path(path).absolute()
    if (path / PARAMS).is_dir():
        root, step = path.parent, int(path.name)
    else:
        root, step = path, None
    pure = _to_pure(target)
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=False, read_only=True),
                               item_handlers={PARAMS: _pytree_handler()}) as mgr:
        step = mgr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no params checkpoint under {root}")
        out = mgr.restore(step, args=ocp.args.Composite(**{
            PARAMS: ocp.args.PyTreeRestore(item=pure, restore_args=_restore_args(pure))}))[PARAMS]
    if hasattr(target, "to_pure_dict"):
        from flax import nnx

        state = jax.tree.map(lambda x: x, target)  # a copy of the abstract structure
        nnx.replace_by_pure_dict(state, out)
        return state
    return out
