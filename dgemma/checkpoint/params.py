"""Params-only checkpoints: `<run dir>/params/<step>/params/`, the params as a plain nested dict, written once at the
end of training (and by `dgemma convert`), read by `checkpoint.init_from`, export, evaluation and sampling.

Orbax plumbing (handler, restore args, tmp-directory cleanup) is shared with `manager.py`; fault handling is the same
(`errors.py`): a full disk is one `CheckpointWriteError` with nothing left behind, a changed model one
`CheckpointMismatchError` naming the first differing path, a damaged step one `CheckpointCorruptError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from dgemma.checkpoint.errors import (
    AbandonedIoReports,
    CheckpointCorruptError,
    CheckpointMismatchError,
    OrbaxFaultLogFilter,
    brief,
    disk_full_errno,
    is_corruption,
    release_frames,
)
from dgemma.checkpoint.manager import (
    PARAMS,
    _ocp,
    _pytree_handler,
    _remove_tmp_dirs,
    _restore_args,
    _write_error,
    dgemma_metadata,
)
from dgemma.checkpoint.structure import check_fits

__all__ = ["restore_params", "save_params"]


def _to_pure(params: Any) -> Any:
    to_pure = getattr(params, "to_pure_dict", None)
    return to_pure() if to_pure is not None else params


def save_params(directory: str | os.PathLike, step: int, params: Any, *,
                metadata: Mapping[str, Any] | None = None) -> Path:
    """Write params only (an `nnx.State` is stored as its plain nested dict) to `<directory>/<step>/`, atomically
    and synchronously. Skips an existing step. Returns the step directory.

    A failed save leaves nothing behind: its temporary directory is removed, and `directory` too if this call created
    it and it stayed empty (a killed process leaves only `<step>.orbax-checkpoint-tmp*`, which no reader lists).

    Raises:
      CheckpointWriteError: the disk is full.
    """
    ocp = _ocp()
    directory = Path(directory).absolute()
    step = int(step)
    created = not directory.exists()
    custom = {**dgemma_metadata(), **dict(metadata or {}), "step": step}
    log_filter = OrbaxFaultLogFilter(str(directory)).install()
    stray = AbandonedIoReports().install()
    failed = False
    try:
        with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
                create=True, enable_async_checkpointing=False, cleanup_tmp_directories=True),
                item_handlers={PARAMS: _pytree_handler()}) as mgr:
            if step not in mgr.all_steps():
                try:
                    mgr.save(step, args=ocp.args.Composite(**{PARAMS: ocp.args.PyTreeSave(_to_pure(params))}),
                             force=True, custom_metadata=custom)
                    mgr.wait_until_finished()
                except Exception as e:
                    failed = True
                    release_frames(e)
                    _remove_tmp_dirs(directory, step)
                    mgr.reload()
                    code = disk_full_errno(e)
                    if code is not None:
                        raise _write_error(f"params step {step}", directory, code, mgr.latest_step(), e) from e
                    raise
    finally:
        if failed:
            stray.drain()
        log_filter.remove()
        stray.remove()
        if created and directory.is_dir() and not any(directory.iterdir()) and jax.process_index() == 0:
            directory.rmdir()
    return directory / str(step)


PARAMS_HINT = ("the config's model differs from the one that wrote these params; use the config of the run that "
               "wrote them (its resolved_config.yaml)")


def restore_params(path: str | os.PathLike, target: Any) -> Any:
    """Restore params written by `save_params` into `target`.

    Args:
      path: the params root (`<run dir>/params`, latest step is used) or one step directory in it.
      target: an `nnx.State` of ShapeDtypeStructs with shardings (or a plain nested dict of them); the result has the
        same type, holding arrays on the target's shardings. Stored dtypes are cast to the target's (a float32
        conversion may initialise a bfloat16 run), so only paths and shapes must match.

    Raises:
      FileNotFoundError: `path` does not exist or holds no params checkpoint.
      CheckpointMismatchError: the stored params do not fit `target` (another model), or `path` is not a params
        checkpoint.
      CheckpointCorruptError: the step's files are truncated or missing.
    """
    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"params checkpoint {path} does not exist" if not path.exists() else
                                f"params checkpoint {path} is not a directory (expected <run dir>/params or a step "
                                f"directory in it)")
    if (path / PARAMS).is_dir():
        root, step = path.parent, int(path.name)
    else:
        root, step = path, None
    pure = _to_pure(target)
    log_filter = OrbaxFaultLogFilter(str(root)).install()
    stray = AbandonedIoReports().install()
    try:
        out = _restore_params_step(root, step, pure)
    except CheckpointCorruptError:
        stray.drain()
        raise
    finally:
        log_filter.remove()
        stray.remove()
    if hasattr(target, "to_pure_dict"):
        from flax import nnx

        state = jax.tree.map(lambda x: x, target)  # a copy of the abstract structure
        nnx.replace_by_pure_dict(state, out)
        return state
    return out


def _restore_params_step(root: Path, step: int | None, pure: Any) -> Any:
    """The params of `step` (None: the latest) under `root`, as a plain nested dict on the target's shardings."""
    ocp = _ocp()
    with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=False, read_only=True),
                               item_handlers={PARAMS: _pytree_handler()}) as mgr:
        step = mgr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no params checkpoint under {root} (expected step directories <step>/{PARAMS})")
        what = f"params checkpoint step {step} in {root}"
        try:
            items = mgr.item_metadata(step)
            if PARAMS not in items.keys():
                raise CheckpointMismatchError(
                    f"{root / str(step)} holds no {PARAMS!r} item (it has {sorted(items.keys())}): not a params "
                    f"checkpoint; pass <run dir>/params or a step directory in it")
            stored = getattr(items[PARAMS], "tree", None)
            if stored is not None:
                check_fits(stored, pure, what=what, hint=PARAMS_HINT, check_dtypes=False)
            return mgr.restore(step, args=ocp.args.Composite(**{
                PARAMS: ocp.args.PyTreeRestore(item=pure, restore_args=_restore_args(pure))}))[PARAMS]
        except Exception as e:
            release_frames(e)
            if not is_corruption(e):
                raise
            raise CheckpointCorruptError(f"{what} is unreadable ({brief(e)})") from e
