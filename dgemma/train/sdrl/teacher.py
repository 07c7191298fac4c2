"""The SD·RL teacher and the student's sampler settings (diffusion_math.md §12.3, §12.6).

The teacher has the student's architecture and is either the frozen stage-1 weights (`sdrl.teacher=frozen`, which
are also the KL reference) or an exponential moving average of the student (`ema`, updated after every iteration:
ema <- d·ema + (1 − d)·student). It decodes with its own, conservative sampler: a larger step budget K_T (default
2 x the student's full budget), gentler temperature annealing, greedy proposals and stability 2. With greedy
proposals only the initial canvas and the renoise draws are random, and they come from the teacher's key, so a
teacher rollout is a deterministic function of (weights, prompts, key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dgemma.inference.sampler_types import SamplerConfig

__all__ = ["ema_update", "student_sampler", "teacher_sampler"]


def student_sampler(cfg, max_steps: int, max_new_tokens: int) -> SamplerConfig:
    """The run's `sampler` section at budget `max_steps` (the curriculum's current K_max), EB diffusion mode."""
    return SamplerConfig.from_section(cfg.sampler, max_steps=int(max_steps), max_new_tokens=int(max_new_tokens),
                                      mode="diffusion")


def teacher_sampler(cfg, max_new_tokens: int) -> SamplerConfig:
    """The teacher's sampler: K_T = `sdrl.teacher_max_steps` (default 2 x `sampler.max_steps`; never below it),
    γ_T, its own temperature range, greedy proposals, stability `sdrl.teacher_stability`."""
    s = cfg.sdrl
    return student_sampler(cfg, cfg.sampler.max_steps, max_new_tokens).replace(
        max_steps=s.teacher_budget(cfg.sampler.max_steps), entropy_bound=s.teacher_entropy_bound,
        t_max=s.teacher_t_max, t_min=s.teacher_t_min, greedy=s.teacher_greedy,
        stability_threshold=s.teacher_stability)


@jax.jit
def _ema(ema, params, decay):
    return jax.tree.map(lambda e, p: (decay * e + (1.0 - decay) * p).astype(e.dtype), ema, params)


def ema_update(ema, params, decay: float):
    """ema <- decay·ema + (1 − decay)·params (same tree, dtypes and shardings as `ema`)."""
    return _ema(ema, params, jnp.float32(decay))
