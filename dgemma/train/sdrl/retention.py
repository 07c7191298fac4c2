"""Retention rows of the SD·RL anchor (`sdrl.retention_mix`, `sdrl.retention_rows`; docs/sdrl.md §4.2).

The anchor keeps the stage-1 loss on (q, y*) for the SD·RL stream's own prompts only, so a task the stream does not
train (copy and sort when stage 2 runs on PICK/FILL) gets no gradient that holds it in place and drifts with the
shared weights (experiments/sdrl_study/results.md, "Nothing forgotten"). A retention stream is a second data stream,
the run's `data` section with the tasks of `sdrl.retention_mix`, `sdrl.retention_rows` rows per iteration and its own
seed; its rows, canvasized with the data's answers as in stage 1, are appended to the anchor rows, so they train
under the same λ_anc and λ_AR'. Iteration i reads the stream's batch i (random access): a resumed run reads the same
rows, and the held-out prompts of a study can be checked against it (`retention_data_config`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["RETENTION_SEED_OFFSET", "RetentionStream", "retention_data_config", "with_retention"]

RETENTION_SEED_OFFSET = 20_011  # another stream than the SD·RL prompts (data.seed) and the held-out prompts (+10_007)


def retention_data_config(cfg):
    """The retention stream's data config (None when `sdrl.retention_mix` is empty)."""
    s = cfg.sdrl
    if not s.retention_mix:
        return None
    return dataclasses.replace(cfg.data, tasks=tuple(s.retention_mix), batch_size=int(s.retention_rows),
                               seed=cfg.data.seed + RETENTION_SEED_OFFSET)


class RetentionStream:
    """This process's retention rows per iteration (the stage-1 layout of the data's (prompt, answer) pairs)."""

    def __init__(self, cfg, tokenizer):
        from dgemma.data.pipeline import DataPipeline

        data_cfg = retention_data_config(cfg)
        if data_cfg is None:
            raise ValueError("RetentionStream: sdrl.retention_mix is empty")
        self.pipeline = DataPipeline(data_cfg, tokenizer=tokenizer)
        if self.pipeline.tokenizer.vocab_size != tokenizer.vocab_size:
            raise ValueError("sdrl.retention_mix: its tokenizer differs from data.tokenizer")

    def rows(self, i: int) -> dict[str, np.ndarray]:
        """Iteration i's rows (the stream repeats when it runs out)."""
        return dict(self.pipeline.batch(i % len(self.pipeline)))

    def tasks(self, i: int) -> list[str]:
        """The task of each of iteration i's rows (metrics, tests)."""
        src = self.pipeline.source
        return [src[int(ix)].task for ix in np.asarray(self.rows(i)["index"])]


def with_retention(anchor: dict[str, np.ndarray], rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The anchor rows (`metrics.anchor_rows`) followed by the retention rows, field by field; both have the stage-1
    layout of the same canvas, so every anchor field must be in `rows` with the same trailing shape."""
    missing = sorted(set(anchor) - set(rows))
    if missing:
        raise ValueError(f"retention rows lack the anchor fields {missing}")
    out = {}
    for k, v in anchor.items():
        r = np.asarray(rows[k]).astype(np.asarray(v).dtype)
        if r.shape[1:] != np.shape(v)[1:]:
            raise ValueError(f"retention rows: field {k} has shape {r.shape[1:]} per row, the anchor's "
                             f"{np.shape(v)[1:]}")
        out[k] = np.concatenate([np.asarray(v), r], axis=0)
    return out
