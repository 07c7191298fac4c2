"""dgemma.train.sdrl: stage 2, SD·RL (sampler distillation + RL on verifiable rewards, docs/sdrl.md).

Modules:
  (config)    `SDRLConfig`, the `sdrl` config section, is `dgemma.config.sdrl_section`; re-exported here
  curriculum  step-budget curriculum (docs/sdrl.md §5), JSON state checkpointed with the run
  targets     verifier-gated SD targets y* and the per-block prefix gate (docs/sdrl.md §3)
  teacher     teacher sampler settings, EMA update
  loss        the jitted loss over recorded states (replay forward -> `dgemma.diffusion.sdrl_objective`)
  iteration   one SD·RL iteration (docs/sdrl.md §5): rollouts, teacher, state rows, μ inner updates
  loop        `SDRLSession` (the trainer's session of trainer.objective=sdrl: reference, EMA,
              curriculum, checkpoint items) and `run_sdrl(cfg, ...) -> SDRLSummary`

`import dgemma.train.sdrl` imports neither jax nor numpy (`SDRLConfig` comes from `dgemma.config.sdrl_section`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgemma._lazy import lazy_exports
from dgemma.config.sdrl_section import ARMS, SDRLConfig, TermWeights

__getattr__, __dir__, _lazy_all = lazy_exports(__name__, {"loop": ("SDRLSummary", "run_sdrl")})

if TYPE_CHECKING:  # the type checker sees the lazily exported names' own types
    from dgemma.train.sdrl.loop import SDRLSummary, run_sdrl

__all__ = sorted(["ARMS", "SDRLConfig", "TermWeights", *_lazy_all])
