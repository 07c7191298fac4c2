"""Retention rows of SD·RL (`sdrl.retention_mix`, `sdrl.retention_rows`, `sdrl.retention_weight`; docs/sdrl.md §3).

The anchor keeps the stage-1 loss on (q, y*) for the SD·RL stream's own prompts only, so a task the stream does not
train (copy and sort when stage 2 runs on PICK/FILL) gets no gradient that holds it in place and drifts with the
shared weights (experiments/sdrl_study/results.md, "Nothing forgotten"). A retention stream is a second data stream:
the run's `data` section with the tasks of `sdrl.retention_mix`, `sdrl.retention_rows` rows per iteration and its own
seed. Its rows, laid out with the data's answers as in stage 1, go to the update under `retention/` and train the
stage-1 loss (the diffusion section's λ_AR) with weight λ_ret = `sdrl.retention_weight`, a term of its own: raising
λ_anc instead also pulls the SD·RL tasks toward the teacher's answers, which costs their speed-up. Iteration i reads
the stream's batch i (random access): a resumed run reads the same rows, and a study's held-out prompts can be
checked against the stream (`retention_data_config`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["RETENTION_SEED_OFFSET", "RetentionStream", "retention_data_config", "term_weights"]

RETENTION_SEED_OFFSET = 20_011  # another stream than the SD·RL prompts (data.seed) and the held-out prompts (+10_007)


def term_weights(sdrl):
    """`sdrl.weights()` with lambda_ret = `sdrl.retention_weight` when a retention mix is set, else 0 (a bare
    `SDRLConfig`, which has no retention fields, gets 0)."""
    on = bool(getattr(sdrl, "retention_mix", ()))
    return dataclasses.replace(sdrl.weights(), retention=float(getattr(sdrl, "retention_weight", 0.0)) if on else 0.0)


def retention_data_config(cfg: RunConfig):
    """The retention stream's data config (None when `sdrl.retention_mix` is empty)."""
    s = cfg.sdrl
    if not s.retention_mix:
        return None
    return dataclasses.replace(cfg.data, tasks=tuple(s.retention_mix), batch_size=int(s.retention_rows),
                               seed=cfg.data.seed + RETENTION_SEED_OFFSET)


class RetentionStream:
    """This process's retention rows per iteration (the stage-1 layout of the data's (prompt, answer) pairs)."""

    def __init__(self, cfg: RunConfig, tokenizer):
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

