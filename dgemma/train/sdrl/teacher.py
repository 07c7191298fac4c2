"""The SD·RL teacher and the student's sampler settings (docs/sdrl.md §4, §5).

The teacher has the student's architecture and is either the frozen stage-1 weights (`sdrl.teacher=frozen`, which
are also the KL reference) or an exponential moving average of the student (`ema`, updated after every iteration:
ema <- d·ema + (1 − d)·student). It decodes with its own, conservative sampler, the run config's nested
`sdrl.teacher_sampler` section over its `sampler` section: by default a larger step limit K_T (2 x the student's full
K_max), gentler temperature annealing, greedy proposals and stability 2. With greedy proposals only the initial
canvas and the renoise draws are random, and they come from the teacher's key, so a teacher rollout is a
deterministic function of (weights, prompts, key).

`sdrl.teacher_decoding` chooses how the teacher decodes: its diffusion sampler (the default, docs/sdrl.md §4), greedy AR on the
same weights (the converted model keeps its AR mode, which can solve tasks its diffusion sampler does not yet), or
both with the better-rewarded output per prompt (`pick_teacher_outputs`). Greedy AR is deterministic too.

`coupled_teacher_tokens` (`sdrl.sd_target=coupled_teacher`): the teacher decodes each STUDENT ROLLOUT's noise. The
sampler derives every draw of row r from fold_in(key, r): block b's initial canvas from fold_in(fold_in(·, b), 0),
step i's proposal and renoise draws from fold_in(fold_in(·, b), i + 1). Called with the student's rows (the repeated
prompts) and the student's key, the teacher therefore starts every block from the canvas the student started from
and draws the same renoise tokens at every step both run (its greedy proposals draw nothing); it only runs more
steps, with its own γ_T and annealing. Its answer is a deterministic function of (prompt, initial canvas, key).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dgemma.inference.sampler_types import SamplerConfig

if TYPE_CHECKING:
    from dgemma.config import RunConfig

__all__ = ["coupled_teacher_tokens", "ema_update", "pick_teacher_outputs", "student_sampler", "teacher_sampler"]


def student_sampler(cfg: RunConfig, max_steps: int, max_new_tokens: int) -> SamplerConfig:
    """The run's `sampler` section at step limit `max_steps` (the curriculum's current K_max), EB diffusion mode."""
    return SamplerConfig.from_section(cfg.sampler, max_steps=int(max_steps), max_new_tokens=int(max_new_tokens),
                                      mode="diffusion")


def teacher_sampler(cfg: RunConfig, max_new_tokens: int) -> SamplerConfig:
    """The teacher's sampler: the `sampler` section with the fields `sdrl.teacher_sampler` sets, K_T =
    `sdrl.teacher_sampler.max_steps` (null: 2 x `sampler.max_steps`; never below it), EB diffusion mode."""
    return SamplerConfig.from_section(cfg.sampler, cfg.sdrl.teacher_sampler,
                                      max_steps=cfg.sdrl.teacher_max_steps(cfg.sampler.max_steps),
                                      max_new_tokens=int(max_new_tokens), mode="diffusion")


def coupled_teacher_tokens(model, rows_prompts, rows_valid, teacher_cfg: SamplerConfig, student_key, n_blocks: int,
                           pad_id: int, *, mesh=None, rules="fsdp") -> np.ndarray:
    """The teacher's answers [R, n_blocks, L] (PAD after the first EOS and in blocks never run) decoded from the
    student rollouts' noise (module docstring): `rows_prompts` / `rows_valid` [R, P] are the rollout rows' prompts
    (`Rollout.prompts`, `.prompt_valid`), `student_key` the key the student rollouts were drawn with (row r:
    fold_in(student_key, r), as `rollout` derives it)."""
    from dgemma.inference.sampler import sample

    R = int(np.shape(rows_prompts)[0])
    res = sample(model, rows_prompts, rows_valid, teacher_cfg.replace(record_states=False, mode="diffusion"),
                 student_key, mode="diffusion", row_ids=np.arange(R), mesh=mesh, rules=rules)
    L = model.cfg.canvas_length
    got = np.asarray(res.tokens)[:, : n_blocks * L]
    out = np.full((R, n_blocks * L), pad_id, np.int32)
    out[:, : got.shape[1]] = got
    return out.reshape(R, n_blocks, L)


@jax.jit
def _ema(ema, params, decay):
    return jax.tree.map(lambda e, p: (decay * e + (1.0 - decay) * p).astype(e.dtype), ema, params)


def ema_update(ema, params, decay: float):
    """ema <- decay·ema + (1 − decay)·params (same tree, dtypes and shardings as `ema`)."""
    return _ema(ema, params, jnp.float32(decay))


def pick_teacher_outputs(mode: str, diffusion: tuple | None, ar: tuple | None):
    """The teacher's outputs per `sdrl.teacher_decoding` from (tokens [Q, n, L], rewards [Q]) of each decoding
    (None where it did not run). Returns (tokens, rewards, from_ar [Q] bool). diffusion_else_ar takes, per prompt,
    the output with the higher reward, the diffusion one on ties (so it changes nothing where diffusion is verified)."""
    # (the iteration runs the decodings `mode` reads: diffusion unless "ar", AR unless "diffusion")
    if mode == "diffusion":
        assert diffusion is not None
        tok, rew = diffusion
        return tok, np.asarray(rew), np.zeros(len(rew), bool)
    if mode == "ar":
        assert ar is not None
        tok, rew = ar
        return tok, np.asarray(rew), np.ones(len(rew), bool)
    if mode != "diffusion_else_ar":
        raise ValueError(f"sdrl.teacher_decoding: unknown {mode!r}")
    assert diffusion is not None and ar is not None
    (d_tok, d_rew), (a_tok, a_rew) = diffusion, ar
    d_rew, a_rew = np.asarray(d_rew), np.asarray(a_rew)
    if d_tok.shape != a_tok.shape or d_rew.shape != a_rew.shape:
        raise ValueError(f"pick_teacher_outputs: diffusion {d_tok.shape}/{d_rew.shape} != AR {a_tok.shape}/"
                         f"{a_rew.shape}")
    from_ar = a_rew > d_rew
    return (np.where(from_ar[:, None, None], a_tok, d_tok).astype(np.int32), np.where(from_ar, a_rew, d_rew),
            from_ar)
