"""The run directory: its atomic creation with the resolved config and its sha, and the config recorded on resume
(`dgemma.train.trainer`; the locks are `dgemma.train.run_lock`'s).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["prepare_run_dir", "record_config", "recorded_config_sha"]

log = logging.getLogger(__name__)


def prepare_run_dir(cfg: Any, *, write: bool = True, defer_existing: bool = False) -> tuple[Path, str]:
    """Create (or reuse) `cfg.run.run_dir` with the resolved config and its sha; returns (run_dir, sha).

    A new run dir is assembled in a hidden temporary sibling and renamed into place. An existing one (resume) gets the
    new resolved config (`record_config`) -- with `defer_existing`, not yet: the caller records it once the resume has
    succeeded, so a failed resume leaves the previous resolved config in place.
    """
    from dgemma import config as config_lib

    run_dir = Path(cfg.run.run_dir).absolute()
    sha = config_lib.config_hash(cfg)
    if not write:
        return run_dir, sha
    if run_dir.is_dir():
        if not defer_existing:
            record_config(cfg, run_dir, sha)
        return run_dir, sha
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.tmp-", dir=run_dir.parent))
    try:
        config_lib.dump_resolved(cfg, tmp)
        os.rename(tmp, run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not run_dir.is_dir():
            raise
        if not defer_existing:
            config_lib.dump_resolved(cfg, run_dir)  # another process created it concurrently
    return run_dir, sha


def recorded_config_sha(run_dir: Path) -> str | None:
    """The sha of the config a run dir was last started with (None: no run there yet)."""
    from dgemma import config as config_lib

    hash_file = Path(run_dir) / config_lib.HASH_NAME
    return hash_file.read_text().strip() if hash_file.exists() else None


def record_config(cfg: Any, run_dir: Path, sha: str) -> None:
    """Write the resolved config into an existing run dir; if its sha changed, the previous file is kept as
    `resolved_config.<old sha12>.yaml`."""
    from dgemma import config as config_lib

    old = recorded_config_sha(run_dir)
    resolved = run_dir / config_lib.RESOLVED_NAME
    if old and old != sha and resolved.exists():
        keep = run_dir / f"resolved_config.{old[:12]}.yaml"
        shutil.copyfile(resolved, keep)
        # logged, not warnings.warn: a user-facing notice, one line without the RuntimeWarning's source line
        log.warning("%s: the config changed since the last start (sha %s -> %s); the previous one is kept as %s",
                    run_dir, old[:12], sha[:12], keep.name)
    config_lib.dump_resolved(cfg, run_dir)
