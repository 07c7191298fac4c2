"""Tracker implementations (see the package docstring). No jax import: usable from any process or tool."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["JsonlTracker", "MultiTracker", "NoopTracker", "Tracker", "WandbTracker", "make_tracker", "read_jsonl"]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"


@runtime_checkable
class Tracker(Protocol):
    """Where metrics go. `log` takes plain Python numbers (floats / ints / strings)."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _plain(value: Any) -> Any:
    """A JSON-friendly Python scalar (numpy / jax scalars -> float/int; non-finite floats -> their string)."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    kind = getattr(getattr(value, "dtype", None), "kind", "f")
    if kind == "b":
        return bool(value)
    if kind in "iu":
        return int(f)
    return f if math.isfinite(f) else str(f)  # JSON has no NaN/inf; "nan"/"inf" strings stay readable


class NoopTracker:
    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlTracker:
    """Appends `{"step": step, **metrics}` lines to `path`; see the package docstring for `resume_step`."""

    def __init__(self, path: str | os.PathLike, *, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._truncate(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def _truncate(self, step: int) -> None:
        keep = [r for r in read_jsonl(self.path) if int(r.get("step", 0)) <= step]
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for r in keep:
                    f.write(json.dumps(r) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class WandbTracker:
    """Weights & Biases run (offline mode works without network)."""

    def __init__(self, *, project: str, entity: str | None = None, mode: str = "online",
                 run_dir: str | os.PathLike | None = None, name: str | None = None,
                 config: Mapping[str, Any] | None = None, run_id: str | None = None):
        import wandb  # noqa: PLC0415 - optional dependency, imported only when enabled

        self._wandb = wandb
        kwargs: dict[str, Any] = dict(project=project, entity=entity, mode=mode, name=name,
                                      config=dict(config or {}), reinit="finish_previous")
        if run_dir is not None:
            kwargs["dir"] = str(run_dir)
        if run_id is not None:
            kwargs.update(id=run_id, resume="allow")
        self.run: Any = wandb.init(**kwargs)  # None once closed

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log({k: _plain(v) for k, v in metrics.items()}, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MultiTracker:
    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for t in self.trackers:
            t.log(step, metrics)

    def close(self) -> None:
        errors = []
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 - close every tracker, then report
                errors.append(e)
        if errors:
            raise errors[0]


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """All complete records of a metrics file (a torn last line from a killed writer is skipped)."""
    out: list[dict] = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("skipping a torn line in %s", p)
    return out


def _wandb_run_id(run_dir: Path) -> str:
    path = run_dir / WANDB_ID_FILE
    if path.exists():
        return path.read_text(encoding="utf-8").strip()
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


class LoggingSettings(Protocol):
    """What `make_tracker` reads: the run config's `logging` section (`dgemma.config.LoggingSection`, a layer above)."""

    @property
    def jsonl(self) -> bool: ...
    @property
    def wandb(self) -> bool: ...
    @property
    def wandb_project(self) -> str: ...
    @property
    def wandb_entity(self) -> str | None: ...
    @property
    def wandb_mode(self) -> str: ...


def make_tracker(cfg: LoggingSettings, run_dir: str | os.PathLike, *, config: Mapping[str, Any] | None = None,
                 config_sha: str | None = None, resume_step: int | None = None, process_index: int = 0,
                 name: str | None = None) -> Tracker:
    """Trackers for a `LoggingSection` (`jsonl`, `wandb`, `wandb_project`, `wandb_entity`, `wandb_mode`).

    Process != 0 gets a `NoopTracker`. wandb failures (not installed, no credentials online, ...) warn and are skipped.
    """
    if process_index != 0:
        return NoopTracker()
    run_dir = Path(run_dir)
    trackers: list[Tracker] = []
    if cfg.jsonl:
        trackers.append(JsonlTracker(run_dir / METRICS_FILE, resume_step=resume_step))
    if cfg.wandb and cfg.wandb_mode != "disabled":
        try:
            full_config = {**dict(config or {}), "config_sha": config_sha}
            trackers.append(WandbTracker(project=cfg.wandb_project, entity=cfg.wandb_entity, mode=cfg.wandb_mode,
                                         run_dir=run_dir, name=name, config=full_config,
                                         run_id=_wandb_run_id(run_dir)))
        except Exception as e:  # noqa: BLE001 - tracking must never take training down
            warnings.warn(f"wandb disabled: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
    if not trackers:
        return NoopTracker()
    return trackers[0] if len(trackers) == 1 else MultiTracker(trackers)
