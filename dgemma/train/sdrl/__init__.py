"""dgemma.train.sdrl: stage 2, SD·RL (sampler distillation + RL on verifiable rewards, docs/sdrl.md).

`import dgemma.train.sdrl` imports neither jax nor numpy (`SDRLConfig`, the `sdrl` section, is
`dgemma.config.sdrl_section`'s; re-exported here).

Modules:
  curriculum      K_max curriculum (docs/sdrl.md §5), JSON state checkpointed with the run
  targets         verifier-gated SD targets y* (incl. the noise-coupled teacher's) and the per-block prefix gate
  teacher         teacher sampler settings, the coupled teacher's decode of the student's noise, EMA update
  states          training rows of one iteration from the student rollouts, SD targets per `sd_target`
  loss            the jitted loss over recorded states (replay forward -> `dgemma.diffusion.sdrl_objective`)
  metrics         per-iteration rollout metrics
  anchor          the anchor rows (q, y*)
  evaluation      the held-out evaluation of an SD·RL run
  retention       retention rows: stage-1 rows of tasks outside the SD·RL stream, their own loss term
  lora_reference  SD·RL with adapters: reference and frozen teacher are the base with adapters off
  iteration       one SD·RL iteration (docs/sdrl.md §5): rollouts, teacher, state rows, μ inner updates
  session         `SDRLSession` (the trainer's session of trainer.objective=sdrl: reference, EMA, curriculum)
  run             `run_sdrl(cfg, ...) -> SDRLSummary` (the trainer on trainer.objective=sdrl)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dgemma._lazy import lazy_exports
from dgemma.config.sdrl_section import ARMS, SDRLConfig, TermWeights

__getattr__, __dir__, _lazy_all = lazy_exports(__name__, {"session": ("SDRLSession",),
                                                          "run": ("SDRLSummary", "run_sdrl")})

if TYPE_CHECKING:  # the type checker sees the lazily exported names' own types
    from dgemma.train.sdrl.run import SDRLSummary, run_sdrl
    from dgemma.train.sdrl.session import SDRLSession

__all__ = sorted(["ARMS", "SDRLConfig", "TermWeights", *_lazy_all])
