"""Metric trackers: jsonl | wandb | noop, behind one small protocol; only process 0 logs (docs/architecture.md §3).

Named `dgemma.tracking` rather than the design's `dgemma.logging`: a package called `logging` reads as the standard
library at every `from dgemma import logging` / `logging.getLogger` site, so this name avoids the confusion. (The config
section stays `logging:` — it is the user-facing name.)

    tracker = make_tracker(cfg.logging, run_dir, config=to_dict(cfg), config_sha=sha, resume_step=start)
    tracker.log(step, {"loss": 2.3, "lr": 1e-4})
    tracker.close()

* `JsonlTracker` appends one JSON object per call to `<run_dir>/metrics.jsonl` (`{"step": s, ...metrics}`), flushed
  and fsynced per line so a killed run loses at most the line being written. With `resume_step=N` it first rewrites
  the file (atomically) keeping only lines with step <= N, so a resumed run's file equals an uninterrupted run's.
* `WandbTracker` logs to Weights & Biases (`logging.wandb_mode`: online | offline | disabled; the run directory is the
  wandb dir, the run id is persisted in `<run_dir>/wandb_run_id` so a resumed run continues the same wandb run). If
  wandb cannot be imported or `wandb.init` fails, `make_tracker` warns and falls back to no wandb.
* `NoopTracker` does nothing (other processes, or everything disabled).

Modules:
  trackers  the tracker implementations and `make_tracker`, `read_jsonl` (no jax import)
"""

from __future__ import annotations

from dgemma.tracking.trackers import (
    JsonlTracker,
    MultiTracker,
    NoopTracker,
    Tracker,
    WandbTracker,
    make_tracker,
    read_jsonl,
)

__all__ = ["JsonlTracker", "MultiTracker", "NoopTracker", "Tracker", "WandbTracker", "make_tracker", "read_jsonl"]
